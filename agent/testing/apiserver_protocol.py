"""What the test API server (``agent.testing.apiserver``) does to objects, whatever holds them.

The resource rows, ``metav1.Status`` failures (``status_object``, ``ApiError``), merge and
JSON patch, label/field selectors, delete preconditions and what counts as a spec change
(``metadata.generation``). Its own module so that the rules read apart from the store, the
HTTP routing and the watch streams; it imports no I/O library.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

JSON = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    """One row of the resource table: adding a resource type is adding one of these."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status: bool = False  # has a /status subresource (status is ignored on main updates)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def status_object(code: int, message: str, reason: str | None = None, **details: Any) -> JSON:
    """A metav1.Status in the exact shape the real apiserver returns for failures."""
    obj: JSON = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "code": code,
    }
    if details:
        obj["details"] = details
    return obj


class ApiError(Exception):
    """Raised inside request handling; becomes a Status response."""

    def __init__(self, code: int, message: str, reason: str | None = None, **details: Any):
        super().__init__(message)
        self.status = status_object(code, message, reason, **details)
        self.code = code


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also used for strategic merge: lists are replaced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, ops: Any) -> Any:
    """Minimal RFC 6902: add, remove, replace, test."""
    if not isinstance(ops, list):
        raise ApiError(400, "json patch body must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        if not parts:
            if kind in ("add", "replace"):
                doc = copy.deepcopy(op.get("value"))
                continue
            raise ApiError(422, f"unsupported root operation {kind!r}")
        parent = doc
        for part in parts[:-1]:
            try:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                raise ApiError(422, f"path {op.get('path')!r} not found") from exc
        last = parts[-1]
        try:
            if kind == "test":
                cur = parent[int(last)] if isinstance(parent, list) else parent[last]
                if cur != op.get("value"):
                    raise ApiError(422, f"test failed at {op.get('path')!r}")
            elif kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif kind in ("add", "replace"):
                value = copy.deepcopy(op.get("value"))
                if isinstance(parent, list):
                    if last == "-":
                        parent.append(value)
                    elif kind == "add":
                        parent.insert(int(last), value)
                    else:
                        parent[int(last)] = value
                else:
                    if kind == "replace" and last not in parent:
                        raise ApiError(422, f"path {op.get('path')!r} not found")
                    parent[last] = value
            else:
                raise ApiError(422, f"unsupported json patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ApiError(422, f"path {op.get('path')!r} not found") from exc
    return doc


def _parse_selector(text: str) -> list[tuple[str, str, str]]:
    """`a=b,c!=d,e,!f` → [(key, op, value)]; set-based `in`/`notin` are not supported."""
    terms: list[tuple[str, str, str]] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            continue
        if "!=" in term:
            k, v = term.split("!=", 1)
            terms.append((k.strip(), "!=", v.strip()))
        elif "==" in term:
            k, v = term.split("==", 1)
            terms.append((k.strip(), "=", v.strip()))
        elif "=" in term:
            k, v = term.split("=", 1)
            terms.append((k.strip(), "=", v.strip()))
        elif " in " in term or " notin " in term:
            raise ApiError(400, f"set-based selector not supported by the test server: {term!r}")
        elif term.startswith("!"):
            terms.append((term[1:].strip(), "!exists", ""))
        else:
            terms.append((term, "exists", ""))
    return terms


def _field(obj: JSON, path: str) -> str | None:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return None if cur is None else str(cur)


def _matches(
    obj: JSON, labels: list[tuple[str, str, str]], fields: list[tuple[str, str, str]]
) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    for key, op, value in labels:
        if op == "exists" and key not in have:
            return False
        if op == "!exists" and key in have:
            return False
        if op == "=" and have.get(key) != value:
            return False
        if op == "!=" and have.get(key) == value:
            return False
    for key, op, value in fields:
        got = _field(obj, key) or ""
        if op == "=" and got != value:
            return False
        if op == "!=" and got == value:
            return False
    return True


def _check_preconditions(obj: JSON, options: Any) -> None:
    """DeleteOptions.preconditions (uid, resourceVersion), as the real server checks them:
    a mismatch is 409 Conflict and nothing is deleted."""
    pre = (options or {}).get("preconditions") if isinstance(options, dict) else None
    for field_name, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
        want = (pre or {}).get(field_name)
        have = (obj.get("metadata") or {}).get(field_name)
        if want and want != have:
            raise ApiError(409, f"Precondition failed: {label} in precondition: {want}, "
                           f"{label} in object meta: {have}", "Conflict")


def _body_of(obj: JSON) -> JSON:
    """The parts of an object whose change bumps metadata.generation."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "kind", "apiVersion")}
