"""Index buckets that stay tuples while small: most of a cluster's buckets hold a handful.

The registry indexes pods by Service, identity and label; at 100k pods over 10k Services
most buckets hold about ten keys, and a set of ten costs 728 bytes against a tuple's 120
(``sys.getsizeof``), which made those three indexes ~25 MB. A bucket is a tuple up to
``SMALL`` keys and a key-only dict beyond (so a 5000-pod Deployment's buckets stay O(1) to
change), and goes back to a tuple when it shrinks to half that. A dict, not a set: a set
built by adding 2000 keys is 131 KB, the dict 74 KB, and a label every pod of a namespace
carries makes one such bucket per namespace. Readers only iterate, size and sort buckets,
which both shapes support."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

SMALL = 16

Bucket = tuple[str, ...] | dict[str, None]


def bucket(keys: Iterable[str]) -> Bucket:
    """``keys`` as a bucket: a tuple when small, else a key-only dict."""
    unique = dict.fromkeys(keys)
    return tuple(unique) if len(unique) <= SMALL else unique


def add_to(index: dict[K, Bucket], key: K, member: str) -> None:
    got = index.get(key)
    if got is None:
        index[key] = (member,)
    elif isinstance(got, tuple):
        if member not in got:
            index[key] = (*got, member) if len(got) < SMALL else dict.fromkeys((*got, member))
    else:
        got[member] = None


def discard_from(index: dict[K, Bucket], key: K, member: str) -> None:
    got = index.get(key)
    if got is None:
        return
    if isinstance(got, tuple):
        if member in got:
            rest = tuple(x for x in got if x != member)
            if rest:
                index[key] = rest
            else:
                del index[key]
        return
    got.pop(member, None)
    if len(got) <= SMALL // 2:
        if got:
            index[key] = tuple(got)
        else:
            del index[key]
