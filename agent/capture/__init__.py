"""Capture: which pods are captured (policy.py) and the nftables rules that do it (rules.py)."""
