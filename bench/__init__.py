"""Benchmarks for aether-agent (root only: real netns, bridge, nftables). See bench/cni_add.py."""
