"""KVEventTracker: the block owners' event records (jaxkv/blocks/kv_events.py) as vLLM's
events (jaxkv/engine/kv_event_wire.py), in the order the records came.

It knows what it published: which media hold each key (a store already published, or a removal
of a key never published, as a radix partial block's, is skipped) and each block's origin while
the device or host holds it, so a demoted or promoted block's event carries its parent and
tokens (vLLM's offloading events tracker does the same). A block it knows nothing of (a disk
file of an earlier run, reached through a hybrid group) is published as vLLM's placeholder:
no parent, no tokens, block size 0. Stores chained in one step are merged into one event.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from jaxkv.blocks.kv_events import GPU, STORAGE, Cleared, Origin, Stored
from jaxkv.engine.kv_event_wire import Wire, external_hash


class KVEventTracker:
    """Records in, wire events out (``events``), one engine's worth of published state.

    Args:
      wire: the encoding's event classes.
      block_size: tokens per block.
    """

    def __init__(self, wire: Wire, block_size: int):
        self.wire = wire
        self.block_size = block_size
        self._held: dict[Hashable, set[str]] = {}    # published key -> the media holding it
        self._origin: dict[Hashable, Origin] = {}    # published key -> origin (disk: no tokens)

    def events(self, records: Sequence) -> list:
        """The wire events of ``records`` (oldest first), as one batch's ``events``."""
        out = []   # (kind, medium, origin or None, key) per event, None for AllBlocksCleared
        touched = set()
        for r in records:
            if isinstance(r, Cleared):
                for media in self._held.values():
                    media.discard(GPU)
                touched.update(self._held)
                out.append(None)
                continue
            touched.add(r.key)
            if isinstance(r, Stored):
                if r.origin is not None:
                    self._origin[r.key] = r.origin
                media = self._held.setdefault(r.key, set())
                if r.medium not in media:
                    media.add(r.medium)
                    out.append(("stored", r.medium, self._origin.get(r.key), r.key))
            elif r.medium in self._held.get(r.key, ()):   # a Removed of a published block
                self._held[r.key].discard(r.medium)
                out.append(("removed", r.medium, self._origin.get(r.key), r.key))
        self._forget(touched)
        return self._encode(out)

    def _forget(self, keys) -> None:
        """Of ``keys``: drop what no medium holds; of what only the disk holds keep the
        identity, not the tokens."""
        for key in keys:
            media = self._held.get(key)
            if media is not None and not media:
                del self._held[key]
                self._origin.pop(key, None)
            elif media == {STORAGE} and self._origin.get(key, Origin(0, 0, 0, ())).tokens:
                self._origin[key] = self._origin[key]._replace(tokens=())

    def _encode(self, out: list) -> list:
        """Wire events of ``events``' entries, chained stores of one medium and group merged
        (a hybrid cache's groups > 0 left out in the array encoding: see kv_event_wire.py)."""
        events, run = [], None   # run: (the open BlockStored, its medium, its group)
        for entry in out:
            if entry is None:
                events.append(self.wire.cleared())
                run = None
                continue
            kind, medium, origin, key = entry
            h, group = (external_hash(origin.key), origin.group) if origin else (
                external_hash(key), None)   # a hybrid group of unknown origin: no group
            if group and self.wire.encoding == "array":
                continue
            if kind == "removed":
                events.append(self.wire.removed([h], medium, group))
                run = None
            elif origin is None or not origin.tokens:   # vLLM's placeholder store
                events.append(self.wire.stored([h], None, [], 0, medium, None, group))
                run = None
            elif (run is not None and run[1:] == (medium, group) and origin.parent is not None
                  and external_hash(origin.parent) == run[0].block_hashes[-1]):
                run[0].block_hashes.append(h)
                run[0].token_ids.extend(origin.tokens)
                if self.wire.encoding == "map":
                    run[0].extra_keys.append(None)
            else:
                events.append(self._stored(medium, origin, h, group))
                run = (events[-1], medium, group)
        return events

    def _stored(self, medium: str, origin: Origin, h: int, group: int):
        """A BlockStored of one block; a prompt's first block has no parent and carries its
        cache salt in ``extra_keys``, as vLLM's."""
        parent = None if origin.parent is None else external_hash(origin.parent)
        salted = origin.parent is None and isinstance(origin.salt, str) and origin.salt
        return self.wire.stored([h], parent, list(origin.tokens), self.block_size, medium,
                                [(origin.salt,) if salted else None], group)
