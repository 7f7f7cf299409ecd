"""envoy"""
