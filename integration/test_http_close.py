"""An HTTP/1.1 client that asks the server to close (`Connection: close`, as HTTP/1.0 clients,
`wrk -H 'Connection: close'` and many libraries do) gets its whole answer through the
HTTP chain of the namespace's internal listener, plaintext and over the mTLS hop.

Envoy 1.40 has a user-space socket send a reset when it closes with data its peer has not
read yet (`envoy.reloadable_features.enable_send_rst_on_user_space_socket`): the HTTP
chain's close after such an answer reached the pod's capture listener as a reset, which it
passed on, and the client got ECONNRESET and no answer. The bootstrap turns the flag off."""

from __future__ import annotations

import socket
from typing import Any

from agent.netns.enter import run_in_netns
from agent.testing.netutil import http_echo_server
from integration.conftest import EnvoyNode
from integration.test_mesh_mtls import _echo_pair, _get_ok, _service, mnode, svid_ttl  # noqa: F401

WEB_IP = "10.96.70.21"


def _close_requests(netns: str, n: int = 5) -> list[bytes]:
    def one() -> bytes:
        s = socket.create_connection((WEB_IP, 80), timeout=5)
        s.sendall(b"GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError as e:
            data += f"<{e}>".encode()
        s.close()
        return data
    return [run_in_netns(netns, one) for _ in range(n)]


def _assert_whole_answers(client_netns: str, srv: Any) -> None:
    """Once the Service answers, five `Connection: close` requests each get a whole answer."""
    try:
        assert _get_ok(client_netns, WEB_IP)[0] == 200
        answers = _close_requests(client_netns)
        assert all(a.startswith(b"HTTP/1.1 200") and a.rstrip().endswith(b"}")
                   for a in answers), [a[:60] for a in answers]
    finally:
        srv.shutdown()


def test_connection_close_gets_the_whole_answer(enode: EnvoyNode) -> None:
    _service(enode, "web", WEB_IP, app="echo", app_protocol="http")  # the HTTP chain, no route
    server = enode.pod(name="server", labels={"app": "echo"})
    client = enode.pod(name="client", annotations={"aether.io/dependencies": "app/web"})
    for p in (server, client):
        enode.add(p)
    srv = http_echo_server(server.netns, "0.0.0.0", 8080, "server")
    _assert_whole_answers(client.netns, srv)


def test_connection_close_gets_the_whole_answer_over_mtls(mnode: EnvoyNode) -> None:  # noqa: F811
    _service(mnode, "web", WEB_IP, app_protocol="http")
    _server, client, srv = _echo_pair(mnode, deps="app/echo,app/web")
    _assert_whole_answers(client.netns, srv)
