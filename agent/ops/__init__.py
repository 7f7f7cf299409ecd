"""What an operator runs or reads: the status rendering, ``top``, the Prometheus metrics and
probes, ``uninstall`` and the demo node."""
