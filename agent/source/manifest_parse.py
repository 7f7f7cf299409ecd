"""Parsing one manifest file into its objects: what the manifest directory
(``agent.source.manifests``) runs in process and the parse worker
(``agent.source.parse_worker``) in a child. Its own module so that the two do not import
each other."""

from __future__ import annotations

from typing import Any

import yaml

from agent.source.yamlsafe import ManifestLimitError, load_all

ObjKey = tuple[str, str, str]  # kind, namespace, name


class ManifestError(ValueError):
    """A file's content is not a usable manifest (the whole file is refused)."""


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def parse_manifest(path: str, data: bytes) -> tuple[dict[ObjKey, dict[str, Any]], list[str]]:
    """One file's objects and its skipped-document warnings; ManifestError if unusable."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"not UTF-8 ({_one_line(e)})") from e
    try:
        docs = load_all(data)
    except ManifestLimitError as e:
        raise ManifestError(f"refused: {_one_line(e)}") from e
    except yaml.YAMLError as e:
        raise ManifestError(f"YAML error: {_one_line(e)}") from e
    except (RecursionError, MemoryError) as e:
        raise ManifestError(f"refused: {type(e).__name__} while loading") from e
    except Exception as e:  # e.g. a timestamp with month 13, an int of 5,000 digits
        raise ManifestError(f"value error: {type(e).__name__}: {_one_line(e)}") from e
    objects: dict[ObjKey, dict[str, Any]] = {}
    warnings: list[str] = []
    for i, doc in enumerate(docs, 1):
        for obj in _flatten(doc, i):
            kind = obj.get("kind")
            meta = obj.get("metadata")
            if not isinstance(kind, str) or not isinstance(meta, dict) or not meta.get("name"):
                warnings.append(f"{path}: document without kind/metadata.name skipped")
                continue
            ns = "" if kind == "Namespace" else str(meta.get("namespace") or "default")
            objects[(kind, ns, str(meta["name"]))] = obj
    return objects, warnings


def _flatten(doc: Any, index: int = 0) -> list[dict[str, Any]]:
    """A document's objects (a List's items); ManifestError when it is not a mapping."""
    if doc is None:
        return []  # an empty document (`---` with nothing after it)
    if not isinstance(doc, dict):
        raise ManifestError(f"document {index} is a {type(doc).__name__}, not a mapping")
    if doc.get("kind") == "List" or (
        isinstance(doc.get("kind"), str) and str(doc["kind"]).endswith("List") and "items" in doc
    ):
        items = doc.get("items")
        if items is None:
            return []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise ManifestError(f"document {index} is a {doc['kind']} whose items are not "
                                "a list of mappings")
        return items
    return [doc]
