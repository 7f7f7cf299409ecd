"""The one place the agent makes a Kubernetes API client (agent.kube.client)."""

from agent.kube.client import KubeConfigError, api_client, raw_options

__all__ = ["KubeConfigError", "api_client", "raw_options"]
