"""YAML for manifests: the C loader when there is one, and bounds on what a document may cost.

``yaml.safe_load`` constructs no arbitrary objects, but it is not cheap to feed hostile input:

- **aliases** (``*name``) share one node however often they are used, so a "billion laughs"
  document of a few hundred bytes stands for 10⁹ nodes; anything that walks the result (a
  comparison, ``str()``, a JSON dump, a merge key ``<<:``) pays for all of them;
- **nesting** is composed by recursion: in libyaml's Cython binding that is C recursion
  without a limit (a few hundred thousand ``[`` overflow the stack and kill the process), and
  Python code that walks a deep result hits ``RecursionError`` far from the file.

``load_all`` therefore walks the parser's event stream first — one iterative pass, no
objects built — and refuses the file (``ManifestLimitError``) when

- a collection is nested deeper than ``MAX_DEPTH`` levels (counting through aliases), or
- aliases would add more than ``MAX_ALIAS_NODES`` nodes beyond the nodes the file itself has
  written so far (each alias counts as the full size of the node it names, as if it were
  written out: ``*a`` naming a 30-node mapping adds 30), or an alias names a node that
  contains it (a recursive structure, never a Kubernetes object).

The rule for aliases keeps the expanded size of what is loaded within twice the file's own
node count plus ``MAX_ALIAS_NODES``: linear in the file's size, whatever its aliases do.
Ordinary anchors (a shared ``env`` list, ``<<: *defaults``, PyYAML's ``&id001`` for a
dumped shared object) stay well inside it. Only then is the document composed and
constructed, by ``yaml.CSafeLoader`` (libyaml, ~10× faster) or ``yaml.SafeLoader`` where
PyYAML was built without libyaml. The walk creates a Python object per event (about half
the cost of loading again), so it is skipped when the text alone rules both out: no
anchor-and-alias pair can occur, and ``depth_bound`` (indentation and brackets) stays
within ``MAX_DEPTH`` — true of ordinary block-style manifests (``within_depth``).
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)

#: Deepest nesting of collections a manifest document may have (Kubernetes objects, CRD
#: schemas included, stay far below; Python code walking the result is safe well above).
MAX_DEPTH = 100
#: How many nodes aliases may add beyond the nodes the file has written (see module doc).
MAX_ALIAS_NODES = 100_000


class ManifestLimitError(ValueError):
    """The document is refused before it is built: too deep, or too many aliased nodes."""


def pick_loader() -> type[Any]:
    """``yaml.CSafeLoader`` when PyYAML has libyaml, else the pure-Python ``SafeLoader``."""
    loader = getattr(yaml, "CSafeLoader", None)
    return loader if loader is not None else yaml.SafeLoader


#: The loader manifests are read with (``pick_loader()`` at import time).
LOADER: type[Any] = pick_loader()


def check_limits(data: bytes | str, loader: type[Any] | None = None, *,
                 max_depth: int = MAX_DEPTH, max_alias_nodes: int = MAX_ALIAS_NODES) -> int:
    """Walk the event stream of ``data``; ManifestLimitError past a bound, yaml.YAMLError on a
    syntax error. Returns the number of nodes the file writes."""
    parser = (loader or LOADER)(data)
    try:
        return _walk(parser, max_depth, max_alias_nodes)
    finally:
        parser.dispose()


def _walk(parser: Any, max_depth: int, max_alias_nodes: int) -> int:
    # per anchor: (nodes when written out, nesting depth); anchors are per document
    sizes: dict[str, tuple[int, int]] = {}
    open_anchors: set[str] = set()
    # per open collection: [nodes written out so far, deepest child collection, anchor]
    stack: list[list[Any]] = []
    written = 0  # nodes the file writes (scalars and collections)
    added = 0  # nodes its aliases add
    get_event = parser.get_event
    while True:
        ev = get_event()
        t = type(ev)
        if t is ScalarEvent:
            written += 1
            if ev.anchor is not None:
                sizes[ev.anchor] = (1, 0)
            if stack:
                stack[-1][0] += 1
        elif t is MappingStartEvent or t is SequenceStartEvent:
            written += 1
            if len(stack) >= max_depth:
                raise ManifestLimitError(
                    f"nested deeper than {max_depth} levels{_where(ev)}")
            if ev.anchor is not None:
                open_anchors.add(ev.anchor)
            stack.append([1, 0, ev.anchor])
        elif t is MappingEndEvent or t is SequenceEndEvent:
            size, below, anchor = stack.pop()
            depth = below + 1
            if anchor is not None:
                sizes[anchor] = (size, depth)
                open_anchors.discard(anchor)
            if stack:
                top = stack[-1]
                top[0] += size
                if depth > top[1]:
                    top[1] = depth
        elif t is AliasEvent:
            ref = sizes.get(ev.anchor)
            if ref is None:
                if ev.anchor in open_anchors:
                    raise ManifestLimitError(
                        f"alias *{ev.anchor} is inside the node it names (a recursive "
                        f"structure){_where(ev)}")
                ref = (1, 0)  # undefined: composing reports it as a YAML error
            size, depth = ref
            added += size
            if added > max_alias_nodes + written:
                raise ManifestLimitError(
                    f"aliases expand to more than {max_alias_nodes} nodes beyond the "
                    f"{written} the file writes (a YAML alias bomb?){_where(ev)}")
            if len(stack) + depth > max_depth:
                raise ManifestLimitError(
                    f"alias *{ev.anchor} nests deeper than {max_depth} levels{_where(ev)}")
            if stack:
                top = stack[-1]
                top[0] += size
                if depth > top[1]:
                    top[1] = depth
        elif t is DocumentStartEvent:
            sizes = {}
            open_anchors = set()
        elif t is StreamEndEvent:
            return written


def _where(ev: Any) -> str:
    mark = getattr(ev, "start_mark", None)
    line = getattr(mark, "line", None)
    return "" if line is None else f" (line {line + 1})"


# A document starts at a line that begins with "---" and a blank (or ends there): no
# collection stays open across it (libyaml closes block collections there, and refuses one
# inside a flow collection or a quoted scalar).
_DOC_START = re.compile(rb"^---(?:[ \t\r\n]|$)", re.MULTILINE)
# What may stand before a block collection's first key or entry on its line: indentation,
# the compact "- ", "? ", ": " indicators, tags and anchors (lines as ``_lines`` makes them).
_BLOCK_PREFIX = re.compile(rb"\n((?:[ \t]|[-?:](?=[ \t])|[!&][^ \t\n]*(?=[ \t]))*)")
_PROPERTY_IN_PREFIX = re.compile(rb"\n[ \t\-?:]*[!&]")
_BOM = b"\xef\xbb\xbf"
_OTHER_BREAKS = (b"\r", b"\xc2\x85", b"\xe2\x80\xa8", b"\xe2\x80\xa9")  # CR, NEL, LS, PS
# An anchor or an alias starts a token: never right after a letter or a digit.
_ANCHOR = re.compile(rb"(?:^|[^A-Za-z0-9])&", re.MULTILINE)
_ALIAS = re.compile(rb"(?:^|[^A-Za-z0-9])\*", re.MULTILINE)


def may_alias(data: bytes) -> bool:
    """False only when ``data`` can hold no alias (an alias needs an anchor before it)."""
    if b"&" not in data or b"*" not in data:
        return False
    return bool(_ANCHOR.search(data)) and bool(_ALIAS.search(data))


def depth_bound(data: bytes) -> int:
    """An upper bound of the nesting depth of any document in ``data`` (aliases aside),
    from the text alone.

    Block collections nest only by indenting: a nested one starts at a column greater than
    its parent's, or equal for a sequence that is a mapping's value, so a chain holds at most
    two per column, and a column is never past the longest block prefix (indentation,
    compact indicators, properties) of a line. Flow collections each need an opening bracket
    in the same document; empty ones ("[]", "{}") hold nothing, so at most one counts.
    """
    lines = _lines(data)
    if lines is None:
        return 1 << 62  # a BOM inside the stream: no bound from the text
    prefix = max(map(len, _BLOCK_PREFIX.findall(lines)), default=0)
    return 2 * (prefix + 1) + _flow_bound(data) + 1


def within_depth(data: bytes, max_depth: int) -> bool:
    """True only if ``depth_bound(data) <= max_depth``; cheaper (a few scans at C speed)."""
    flow = _flow_bound(data)
    room = (max_depth - flow - 1) // 2 - 1  # the longest block prefix that fits
    lines = _lines(data)
    if room < 0 or lines is None:
        return False
    if re.search(rb"\n[ \t\-?:]{%d}" % (room + 1), lines):
        return False  # a line's prefix (counted loosely) is too long: maybe too deep
    if _PROPERTY_IN_PREFIX.search(lines):  # a tag or an anchor in a prefix: measure exactly
        return depth_bound(data) <= max_depth
    return True


def _lines(data: bytes) -> bytes | None:
    """``data`` with every YAML line break a "\\n" and a "\\n" in front (so every line,
    the first too, starts after one); None when a BOM stands anywhere but at the start."""
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    if _BOM in data:
        return None
    for brk in _OTHER_BREAKS:
        if brk in data:
            data = data.replace(brk, b"\n")
    return b"\n" + data


def _flow_bound(data: bytes) -> int:
    flow = _opened(data)
    if flow > 8:  # worth counting per document
        flow = max(map(_opened, _DOC_START.split(data)), default=0)
    return flow


def _opened(doc: bytes) -> int:
    return doc.count(b"[") + doc.count(b"{") - doc.count(b"[]") - doc.count(b"{}")


def load_all(data: bytes | str, loader: type[Any] | None = None, *,
             max_depth: int = MAX_DEPTH, max_alias_nodes: int = MAX_ALIAS_NODES) -> list[Any]:
    """Every document of ``data``, after ``check_limits``; the errors are the same.

    The event walk costs about half as much again as loading; it is skipped when the text
    alone shows that no alias can occur and no document can nest past ``max_depth``."""
    cls = loader or LOADER
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if may_alias(raw) or not within_depth(raw, max_depth):
        check_limits(data, cls, max_depth=max_depth, max_alias_nodes=max_alias_nodes)
    return list(yaml.load_all(data, Loader=cls))
