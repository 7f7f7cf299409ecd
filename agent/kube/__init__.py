"""The one place the agent makes a Kubernetes API client (agent.kube.client)."""

from agent.kube.client import KubeConfigError, abandon, api_client, done, raw_options

__all__ = ["KubeConfigError", "abandon", "api_client", "done", "raw_options"]
