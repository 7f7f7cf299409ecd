"""CNI: the kubelet-facing shim (plugin.py), the wire protocol (protocol.py), and the agent's
request handler (handler.py) behind the unix socket (server.py).

This package's __init__ stays import-free: the shim is exec'd on every pod start.
"""
