"""Node-level duties of the agent: the readiness taint and repair of pods it never captured."""
