"""CNI semantics for a request relayed by the shim: pure functions, no I/O.

`parse()` turns the shim's envelope (CNI_* variables + raw netconf) into either an early
answer (a CNI error, VERSION) or a normalized request for the handler; `render()` turns the
handler's verdict into what kubelet reads: the exit code and stdout (prevResult unchanged on
ADD, nothing on DEL/CHECK, a CNI error object on failure).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from agent.cni import codes as p
from agent.cni.messages import CniFailure, CniRequest
from agent.common.ids import ContainerId

CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}\Z")  # \Z: no trailing newline


def cni_error(code: int, msg: str, details: str = "", version: str = "1.0.0") -> dict[str, Any]:
    return {"cniVersion": version, "code": code, "msg": msg, "details": details}


def parse_cni_args(raw: str) -> dict[str, str]:
    """CNI_ARGS 'IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;…' → dict (malformed pairs skipped)."""
    out: dict[str, str] = {}
    for part in raw.split(";"):
        key, sep, value = part.partition("=")
        if sep and key.strip():
            out[key.strip()] = value.strip()
    return out


def prev_result_ips(prev: Any) -> list[str]:
    """Addresses from a prevResult of any supported version (0.3+ all use `ips`)."""
    ips: list[str] = []
    if isinstance(prev, dict) and isinstance(prev.get("ips"), list):
        for entry in prev["ips"]:
            if isinstance(entry, dict) and isinstance(entry.get("address"), str):
                ips.append(entry["address"].split("/")[0])
    return ips


Answer = tuple[int, str]


def _fail(code: int, msg: str, details: str = "", version: str = "1.0.0") -> Answer:
    return 1, json.dumps(cni_error(code, msg, details, version))


def parse(envelope: Any) -> tuple[Answer | None, dict[str, Any]]:
    """(early answer, None-ish) or (None, handler request)."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("env"), dict):
        return _fail(p.ERR_DECODE, "malformed request from aether-cni"), {}
    env = {str(k): str(v) for k, v in envelope["env"].items()}
    command = env.get("CNI_COMMAND", "")
    if command == "VERSION":
        return (0, json.dumps({"cniVersion": "1.0.0",
                               "supportedVersions": p.SUPPORTED_VERSIONS})), {}
    netconf = envelope.get("stdin")
    if netconf is None:
        netconf = {}
    if not isinstance(netconf, dict):
        return _fail(p.ERR_DECODE, "failed to decode network configuration",
                     "netconf is not a JSON object"), {}
    version = str(netconf.get("cniVersion", "1.0.0"))
    if version not in p.SUPPORTED_VERSIONS:
        return _fail(p.ERR_INCOMPATIBLE_VERSION, f"unsupported cniVersion {version!r}",
                     f"supported: {', '.join(p.SUPPORTED_VERSIONS)}"), {}
    if command not in ("ADD", "DEL", "CHECK", "STATUS", "GC"):  # STATUS, GC: CNI 1.1
        return _fail(p.ERR_INVALID_ENV, f"unknown CNI_COMMAND {command!r}", "", version), {}
    if command in ("ADD", "CHECK") and not isinstance(netconf.get("prevResult"), dict):
        return _fail(p.ERR_INVALID_NETCONF,
                     "aether-cni must be chained after a primary plugin: prevResult is missing",
                     "", version), {}
    if command == "ADD" and not env.get("CNI_NETNS"):
        return _fail(p.ERR_INVALID_ENV, "CNI_NETNS is required for ADD", "", version), {}
    return None, {
        "command": command,
        "container_id": env.get("CNI_CONTAINERID", ""),
        "netns": env.get("CNI_NETNS", ""),
        "ifname": env.get("CNI_IFNAME", ""),
        "args": parse_cni_args(env.get("CNI_ARGS", "")),
        "cni_version": version,
        "netconf": netconf,
        "ips": prev_result_ips(netconf.get("prevResult")),
    }


def render(request: dict[str, Any], verdict: dict[str, Any]) -> Answer:
    version = str(request.get("cni_version") or "1.0.0")
    if not verdict.get("ok"):
        return _fail(int(verdict.get("code") or p.ERR_CAPTURE_FAILED),
                     str(verdict.get("msg") or "aether agent refused the request"),
                     str(verdict.get("details") or ""), version)
    if request["command"] == "ADD":
        result = dict(request["netconf"]["prevResult"])
        result.setdefault("cniVersion", version)
        return 0, json.dumps(result)
    return 0, ""


def encode(answer: Answer) -> bytes:
    return f"{answer[0]}\n{answer[1]}".encode()


def to_request(request: Any) -> CniRequest:
    """The parsed wire form → a frozen ``CniRequest``, or ``CniFailure`` naming the CNI error:
    the command, a well-formed container id, a clean absolute netns path, typed fields."""
    if not isinstance(request, dict):
        raise CniFailure(p.ERR_BAD_REQUEST, "request is not a JSON object")
    command = request.get("command")
    if command not in ("ADD", "DEL", "CHECK"):
        raise CniFailure(p.ERR_BAD_REQUEST, f"unknown command {command!r}")
    cid = request.get("container_id")
    if not isinstance(cid, str) or not CONTAINER_ID.match(cid):
        raise CniFailure(p.ERR_INVALID_ENV, "CNI_CONTAINERID missing or malformed")
    netns = request.get("netns") or ""
    args = request.get("args") or {}
    netconf = request.get("netconf") or {}
    ips = request.get("ips") or []
    if not isinstance(netns, str) or not isinstance(args, dict) \
            or not isinstance(netconf, dict) or not isinstance(ips, list):
        raise CniFailure(p.ERR_BAD_REQUEST, "request fields have the wrong types")
    if netns and (not os.path.isabs(netns) or ".." in netns.split("/")):
        raise CniFailure(p.ERR_INVALID_ENV, f"netns path {netns!r} is not a clean absolute path")
    return CniRequest(
        command=command, container_id=ContainerId(cid), netns=netns,
        ifname=str(request.get("ifname") or ""),
        args={str(k): str(v) for k, v in args.items()}, netconf=netconf,
        ips=tuple(str(i) for i in ips))
