"""Shared fixtures: the project's test API server and a real `kubernetes` client for it.
A module may override `server` (seeded objects, extra resources); `api` follows it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from agent.testing.apiserver import FakeApiServer


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as srv:
        yield srv


@pytest.fixture
def api(server: FakeApiServer, tmp_path: Path) -> Iterator[client.ApiClient]:
    cfg = client.Configuration()
    config.load_kube_config(config_file=server.kubeconfig(tmp_path / "kubeconfig"),
                            client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client
