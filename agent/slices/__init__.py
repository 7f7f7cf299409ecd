"""Opt-in EndpointSlice projection of the registry's local endpoints (proposal 020, Part 2)."""
