"""MeshPod records: each node publishes its managed pods so no node lists every Pod."""
