"""The gRPC face of the xDS server: the ADS servicer (SotW and delta streams) and the loop
that serves one stream, a reader thread feeding requests in and the stream's queue
drained out.

Split from ``agent.envoy.xds`` so the server there holds the snapshot, versions and the
ACK/NACK bookkeeping, and only this module knows how gRPC hands a stream over. It reaches
the server through ``StreamHost``, the few calls a stream makes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc

from agent.envoy.xds_wire import _Stream


class StreamHost(Protocol):
    """What a stream needs of the xDS server (``agent.envoy.xds.XdsServer``)."""

    log: logging.Logger

    def _register(self, delta: bool, peer: str) -> _Stream: ...

    def _unregister(self, st: _Stream) -> None: ...

    def _on_request(self, st: _Stream, type_url: str, nonce: str, node_id: str, error: Any,
                    initial_versions: dict[str, str] | None, req: Any = None) -> None: ...


def serve_stream(host: StreamHost, st: _Stream, requests: Iterator[Any],
                 context: grpc.ServicerContext) -> Iterator[Any]:
    def reader() -> None:
        try:
            for req in requests:
                err = req.error_detail if req.HasField("error_detail") else None
                init = dict(req.initial_resource_versions) if st.delta else None
                host._on_request(st, req.type_url, req.response_nonce, req.node.id,
                                 err, init, req)
        except Exception as e:  # client went away / server stopping
            host.log.debug("stream %d reader ended: %s", st.sid, e)
        finally:
            st.out.put(None)

    context.add_callback(lambda: st.out.put(None))
    t = threading.Thread(target=reader, name=f"xds-reader-{st.sid}", daemon=True)
    t.start()
    try:
        while True:
            item = st.out.get()
            if item is None or not context.is_active():
                return
            yield item
    finally:
        host._unregister(st)


class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]  # untyped stubs
    def __init__(self, server: StreamHost) -> None:
        self._s = server

    def StreamAggregatedResources(  # noqa: N802 - grpc naming
        self, request_iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[Any]:
        st = self._s._register(False, context.peer())
        return serve_stream(self._s, st, request_iterator, context)

    def DeltaAggregatedResources(  # noqa: N802 - grpc naming
        self, request_iterator: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[Any]:
        st = self._s._register(True, context.peer())
        return serve_stream(self._s, st, request_iterator, context)
