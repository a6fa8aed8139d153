"""KV-cache event records: what the block owners append to their outbox (``kv_events``, a
plain list, None while off) when a prefix block is cached on a medium or leaves it, for the
engine to drain each step and publish in vLLM's wire format (jaxkv/engine/kv_event_tracker.py).

The records live in the owners' state, so they follow its copies: a plan the engine drops takes
its records with it. Design notes: docs/server.md (KV-cache events)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"   # vLLM's medium names: device pool, host, disk


class Origin(NamedTuple):
    """What a cached block's key hashes: the facts an event about it carries.

    Attributes:
      key: its group-0 prefix key (``PrefixCache.key`` chain; a hybrid cache's group ``g > 0``
        caches it under ``group_key(key, g)``).
      group: its hybrid cache group (0 without one).
      parent: the group-0 key of the block before it, or None for a prompt's first block.
      tokens: its ``block_size`` token ids.
      salt: the cache salt its chain started from (a request's ``cache_salt``), or None.
    """

    key: Hashable
    group: int
    parent: Hashable | None
    tokens: tuple[int, ...]
    salt: Hashable = None


class Stored(NamedTuple):
    """A block newly cached on ``medium`` under ``key`` (the key its owner files it under: a
    group key for a hybrid group > 0). ``origin``: None where the owner does not know it (a
    demoted or promoted block: the engine remembers it from the block's first store)."""

    medium: str
    key: Hashable
    origin: Origin | None = None


class Removed(NamedTuple):
    """A block cached under ``key`` left ``medium`` (evicted, or reset). A key the engine never
    published (a radix partial block) is skipped there."""

    medium: str
    key: Hashable


class Cleared(NamedTuple):
    """The device prefix cache was reset (vLLM's ``AllBlocksCleared``)."""


KVEventRecord = Stored | Removed | Cleared


def record(outbox: list | None, event: KVEventRecord) -> None:
    """Append ``event`` to an owner's ``outbox`` unless events are off (None)."""
    if outbox is not None:
        outbox.append(event)
