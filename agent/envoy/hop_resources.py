"""The mesh hop's node-wide resources in the xDS build (split out of
``agent.envoy.resources``): the ``mtls-out`` and ``inbound-detect`` listeners, the
per-identity ``mtls|<ns>|<sa>`` clusters, the ``inbound-detect`` and ``inbound-deliver``
clusters and the SDS secrets. Each depends only on its key, so it is built once and served
as the same object while used. Pure: ``ResourceBuilder`` drives it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf.message import Message

from agent.envoy import mtls
from agent.envoy.clusters import upstream_bind_config
from agent.envoy.mtls_common import MeshTls


class HopResources:
    """The mesh hop's resources by key; what a build did not use is dropped by ``sweep``."""

    def __init__(self) -> None:
        # resources that depend only on their key (mTLS listeners and clusters)
        self._fixed_cache: dict[Any, Any] = {}
        self._fixed_used: set[Any] = set()
        self._secrets: tuple[Any, dict[str, Message], Any] = ((), {}, ())

    def listeners(self) -> dict[str, Any]:
        """``mtls-out`` and the node's ``inbound-detect``, by name."""
        return {
            mtls.MTLS_OUT_LISTENER: self._fixed("mtls-out", mtls.build_mtls_out_listener),
            mtls.INBOUND_DETECT: self._fixed("inbound-detect", mtls.build_inbound_detect_listener),
        }

    def add_clusters(self, clusters: dict[str, Any], tls: MeshTls, identities: Iterable[str],
                     mark: int, t: float, detect_clusters: Sequence[cluster_pb2.Cluster]) -> None:
        """Into ``clusters``: the mtls cluster of each identity in ``identities`` (in order),
        ``inbound-detect``, the pods' own detection clusters and ``inbound-deliver``."""
        bind_key = (mark, t)

        def bound(build: Callable[..., cluster_pb2.Cluster], *args: Any
                  ) -> Callable[[], cluster_pb2.Cluster]:
            """``build`` with the mesh clusters' bind config, made on a cache miss only."""
            return lambda: build(*args, bind=upstream_bind_config(mark), connect_timeout_s=t)

        for identity in identities:
            clusters[mtls.mtls_cluster_name(identity)] = self._fixed(
                ("mtls", identity, tls.trust_domain, tls.inbound_port, bind_key),
                bound(mtls.build_mtls_cluster, identity, tls))
        clusters[mtls.INBOUND_DETECT] = self._fixed(
            ("inbound-detect", t), lambda: mtls.build_inbound_detect_cluster(t))
        for c in detect_clusters:
            clusters[c.name] = c
        clusters[mtls.INBOUND_DELIVER_CLUSTER] = self._fixed(
            ("inbound-deliver", bind_key), bound(mtls.build_inbound_deliver_cluster))

    def sweep(self) -> None:
        """Drop what the build now ending did not use."""
        self._fixed_cache = {k: v for k, v in self._fixed_cache.items() if k in self._fixed_used}
        self._fixed_used = set()

    def _fixed(self, key: Any, make: Callable[[], Any]) -> Any:
        """A resource that depends only on ``key``: built once, the same object while used."""
        self._fixed_used.add(key)
        got = self._fixed_cache.get(key)
        if got is None:
            got = self._fixed_cache[key] = make()
        return got

    def secrets(self, tls: MeshTls) -> dict[str, Message]:
        """SDS resources, the same dict while the SVIDs and bundle are the same objects. The
        entry holds the SVIDs its key names by id: a renewed SVID allocated where a freed one
        was would otherwise match the old key and never reach Envoy."""
        key = (tuple(sorted((k, id(v)) for k, v in tls.svids.items())), tls.bundle_pem)
        if self._secrets[0] != key:
            self._secrets = (key, dict(mtls.build_secrets(tls)), tuple(tls.svids.values()))
        return self._secrets[1]
