"""`cni-install`: put the `aether-cni` plugin into the node's CNI config and bin dir, keep it there."""
