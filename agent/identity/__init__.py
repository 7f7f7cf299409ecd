"""Workload identity: SPIFFE SVIDs for the ServiceAccounts with captured pods on this node.

``svid`` holds the plain data and the renewal arithmetic (pure), ``ca_dir`` the standalone
provider that signs SVIDs from a CA directory, ``manager`` the holder that issues, renews and
hands them to the xDS publisher."""
