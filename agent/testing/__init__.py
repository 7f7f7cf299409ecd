"""Test doubles that speak real protocols, so tests exercise the production client code."""

from agent.testing.apiserver import RESOURCES, FakeApiServer, Resource, status_object

__all__ = ["RESOURCES", "FakeApiServer", "Resource", "status_object"]
