"""The host KV tier: which host slots hold which KV blocks (host bookkeeping, no jax).

Design notes: docs/scheduling.md."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

from jaxkv.blocks.kv_events import CPU, STORAGE, Origin, Removed, Stored, record
from jaxkv.blocks.prefix_cache import group_key, longest_match

NO_SLOT = -1   # a swapped sequence's entry for a block its retention policy had dropped


@dataclasses.dataclass(frozen=True)
class SwapCostModel:
    """Seconds to bring back a preempted sequence by swapping vs by recomputing it.

    swap: ``blocks x block_bytes / d2h + blocks x block_bytes / h2d`` (out now, in later);
    recompute: ``uncached tokens / prefill rate``. The engine fits the rates from what it
    measures: the copy bandwidths once at start-up (``HostKVPool.measure``: live copies
    overlap the steps, so their wall time is not their cost), the prefill rate as a moving
    average over its own steps.

    Attributes:
      block_bytes: bytes of one all-layer block unit.
      d2h_bytes_per_s, h2d_bytes_per_s: measured copy bandwidths (None: not yet measured).
      prefill_tokens_per_s: measured prefill rate (None: not yet measured).
    """

    block_bytes: int
    d2h_bytes_per_s: float | None = None
    h2d_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None

    def swap_seconds(self, num_blocks: int) -> float | None:
        """Estimated seconds to copy ``num_blocks`` out and back in (None: unmeasured)."""
        if not self.d2h_bytes_per_s or not self.h2d_bytes_per_s:
            return None
        size = num_blocks * self.block_bytes
        return size / self.d2h_bytes_per_s + size / self.h2d_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float | None:
        """Estimated seconds to recompute ``num_tokens`` tokens (None: unmeasured)."""
        if not self.prefill_tokens_per_s:
            return None
        return num_tokens / self.prefill_tokens_per_s

    def prefers_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether swapping ``num_blocks`` is estimated faster than recomputing ``num_tokens``
        (False until both rates are measured: recompute is the safe default)."""
        swap, recompute = self.swap_seconds(num_blocks), self.recompute_seconds(num_tokens)
        return swap is not None and recompute is not None and swap < recompute


class HostTier:
    """Host slots of the KV offload tier: prefix blocks (LRU) and swapped sequences.

    Args:
      num_slots: host blocks (all usable; there is no null slot).
      disk: a ``jaxkv.kvcache.disk_store.DiskKVStore`` behind the prefix slots, or None. It is
        shared by every copy (it is a cache of files, not scheduler state).
    """

    def __init__(self, num_slots: int, disk=None):
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1")
        self.num_slots = num_slots
        self.disk = disk
        self._free = list(range(num_slots - 1, -1, -1))      # stack: slot 0 is taken first
        self._lru: OrderedDict[Hashable, int] = OrderedDict()  # prefix key -> slot, oldest first
        self._key_of: dict[int, Hashable] = {}                 # prefix slot -> key
        self._node: dict[Hashable, tuple[Hashable, tuple[int, ...]]] = {}  # radix key -> node
        self._children: dict[Hashable, tuple[Hashable, ...]] = {}  # parent key -> radix keys
        self._swapped: dict[Hashable, tuple[int, ...]] = {}    # request id -> slot per block
        self._busy: set[int] = set()        # slots this plan's transfers read or write
        self._deferred: list[int] = []      # slots given up this plan, free from the next one
        self.kv_events: list | None = None  # cache transitions (jaxkv/blocks/kv_events.py)

    def copy(self) -> HostTier:
        """An independent copy (the disk store is shared)."""
        new = object.__new__(HostTier)
        new.num_slots, new.disk = self.num_slots, self.disk
        new._free = list(self._free)
        new._lru = OrderedDict(self._lru)
        new._key_of = dict(self._key_of)
        new._node = dict(self._node)
        new._children = dict(self._children)
        new._swapped = dict(self._swapped)
        new._busy = set(self._busy)
        new._deferred = list(self._deferred)
        new.kv_events = None if self.kv_events is None else list(self.kv_events)
        return new

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_prefix_blocks(self) -> int:
        """Host slots holding prefix blocks."""
        return len(self._lru)

    @property
    def num_swapped_blocks(self) -> int:
        """Host slots holding swapped sequences' blocks."""
        return sum(sum(s != NO_SLOT for s in slots) for slots in self._swapped.values())

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def __contains__(self, key: Hashable) -> bool:
        """Whether a prefix block with ``key`` is on the host."""
        return key in self._lru

    def swapped(self, request_id: Hashable) -> tuple[int, ...] | None:
        """Host slot per logical block of a swapped-out request (``NO_SLOT``: dropped), or None."""
        return self._swapped.get(request_id)

    def available(self) -> int:
        """Slots a swap-out could take now: free ones plus prefix slots not busy."""
        return len(self._free) + sum(s not in self._busy for s in self._lru.values())

    # ---- a plan ----------------------------------------------------------------------------

    def begin_plan(self) -> None:
        """Start a new plan: the previous plan's transfers have run (its busy slots are read,
        its given-up slots may be reused)."""
        self._free.extend(self._deferred)
        self._deferred = []
        self._busy = set()

    def _alloc(self) -> int | None:
        """A slot to write: a free one, else the least recently used prefix slot not busy."""
        if self._free:
            return self._free.pop()
        for key, slot in self._lru.items():
            if slot not in self._busy:
                del self._lru[key]
                del self._key_of[slot]
                self._unindex(key)
                record(self.kv_events, Removed(CPU, key))
                return slot
        return None

    # ---- prefix blocks ---------------------------------------------------------------------

    def demote(self, key: Hashable, block: int,
               node: tuple[Hashable, tuple[int, ...]] | None = None, *, partial: bool = False
               ) -> tuple[int, int, Hashable | None] | None:
        """A device prefix block ``block`` (cached under ``key``) is being reused: keep its KV.

        Args:
          node: radix mode's ``(parent key, tokens)`` of the block (``PrefixCache.node``),
            indexed for ``partial``; None in hash mode.
          partial: the block holds fewer than ``block_size`` tokens (radix mode). It takes a
            free slot only, never pushing a host block out (it is worth fewer tokens, and no
            block's hash chain runs through it), and stays off the disk store.

        Returns the swap-out ``(block, slot, key)`` to apply (``key`` None for a partial
        block), or None when the host already holds ``key`` (it becomes the most recently
        used) or has no slot to give.
        """
        if key in self._lru:
            self._lru.move_to_end(key)
            return None
        slot = None if partial and not self._free else self._hold(key)
        if slot is None:
            return None
        if node is not None:
            self._node[key] = node
            self._children[node[0]] = self._children.get(node[0], ()) + (key,)
        if not partial:   # a full block goes to disk too once it lands (kv_offload.py)
            record(self.kv_events, Stored(CPU, key))
            if self.disk is not None and key not in self.disk:
                record(self.kv_events, Stored(STORAGE, key))
        return block, slot, None if partial else key

    def _unindex(self, key: Hashable) -> None:
        """Drop ``key`` from the radix index (no-op for a hash-mode block)."""
        node = self._node.pop(key, None)
        if node is not None:
            siblings = tuple(k for k in self._children.pop(node[0]) if k != key)
            if siblings:
                self._children[node[0]] = siblings

    def partial(self, parent: Hashable, tokens: Sequence[int]) -> tuple[Hashable, int] | None:
        """``(key, k)``: the radix block on the host after ``parent`` whose first ``k >= 1``
        tokens equal ``tokens[:k]`` (longest ``k``, as ``RadixPrefixCache.partial``), or None."""
        return longest_match(((k, self._node[k][1]) for k in self._children.get(parent, ())),
                             tokens)

    def _hold(self, key: Hashable) -> int | None:
        """A slot (``_alloc``) for prefix block ``key``, written this plan (busy), or None."""
        slot = self._alloc()
        if slot is not None:
            self._lru[key] = slot
            self._key_of[slot] = key
            self._busy.add(slot)
        return slot

    def find(self, key: Hashable) -> int | None:
        """The host slot of prefix block ``key`` (now most recently used and busy), or None."""
        slot = self._lru.get(key)
        if slot is not None:
            self._lru.move_to_end(key)
            self._busy.add(slot)
        return slot

    def load(self, key: Hashable, origin: Origin | None = None):
        """Prefix block ``key`` (whose ``origin`` the caller may know, for its events) from
        the disk store into a host slot.

        Returns ``(slot, row)`` (the verified uint8 bytes the runner writes into that slot
        before the swap-ins), or None when the disk has no valid file for ``key`` (a corrupt or
        foreign file is refused there, logged, and counted) or no slot is free.
        """
        if self.disk is None:
            return None
        on_disk = key in self.disk
        row = self.disk.load(key)
        if row is None and on_disk:   # refused
            record(self.kv_events, Removed(STORAGE, key))
        slot = None if row is None else self._hold(key)
        if slot is None:
            return None
        record(self.kv_events, Stored(STORAGE, key, origin))   # announced once (the engine)
        record(self.kv_events, Stored(CPU, key, origin))
        return slot, row

    def reset_prefix(self) -> None:
        """Forget every host prefix block (swapped sequences stay; the disk is kept)."""
        for key, slot in self._lru.items():
            del self._key_of[slot]
            (self._deferred if slot in self._busy else self._free).append(slot)
            record(self.kv_events, Removed(CPU, key))
        self._lru = OrderedDict()
        self._node, self._children = {}, {}

    def take_kv_events(self) -> list:
        """The KV-cache event records since the last call, oldest first (none while
        ``kv_events`` is None)."""
        out = self.kv_events or []
        if self.kv_events is not None:
            self.kv_events = []
        return out

    # ---- swapped sequences -----------------------------------------------------------------

    def swap_out(self, request_id: Hashable, table: Sequence[int], null_block: int = 0
                 ) -> tuple[tuple[int, int, None], ...] | None:
        """Give ``request_id`` a host slot per kept block of ``table`` (its device blocks).

        Returns the swap-outs ``(block, slot, None)``, or None (nothing changed) when the host
        cannot hold them all.
        """
        if request_id in self._swapped:
            raise ValueError(f"request_id={request_id!r} is already swapped out")
        need = sum(b != null_block for b in table)
        if need > self.available():
            return None
        slots, ops = [], []
        for block in table:
            if block == null_block:
                slots.append(NO_SLOT)
                continue
            slot = self._alloc()
            self._busy.add(slot)
            slots.append(slot)
            ops.append((block, slot, None))
        self._swapped[request_id] = tuple(slots)
        return tuple(ops)

    def swap_in(self, request_id: Hashable) -> tuple[int, ...]:
        """End ``request_id``'s swap: its slot per logical block (``NO_SLOT``: dropped). The
        slots are busy this plan (the swap-ins read them) and free from the next one."""
        slots = self._swapped.pop(request_id)
        kept = [s for s in slots if s != NO_SLOT]
        self._busy.update(kept)
        self._deferred.extend(kept)
        return slots

    def drop(self, request_id: Hashable) -> None:
        """Forget a swapped request that will not resume (finished or aborted while waiting)."""
        slots = self._swapped.pop(request_id, None)
        if slots is not None:   # free from the next plan on, as a resumed request's
            self._deferred.extend(s for s in slots if s != NO_SLOT)

    # ---- checking --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless every slot is exactly one of: free, deferred, a
        prefix block's, a swapped block's; and the prefix maps are mutually inverse."""
        owners = list(self._free) + list(self._deferred) + list(self._lru.values())
        owners += [s for slots in self._swapped.values() for s in slots if s != NO_SLOT]
        _check(sorted(owners) == list(range(self.num_slots)),
               "host slots are not partitioned into free / deferred / prefix / swapped")
        _check(len(self._key_of) == len(self._lru)
               and all(self._key_of[s] == k for k, s in self._lru.items()),
               "host prefix maps differ")
        _check(set(self._node) <= set(self._lru), "a radix node indexed without its slot")
        index: dict[Hashable, list[Hashable]] = {}
        for key, (parent, _) in self._node.items():
            index.setdefault(parent, []).append(key)
        _check({p: sorted(map(repr, c)) for p, c in index.items()}
               == {p: sorted(map(repr, c)) for p, c in self._children.items()},
               "host radix child index broken")
        swapped = {s for slots in self._swapped.values() for s in slots}
        _check(not self._busy - set(self._lru.values()) - set(self._deferred) - swapped,
               "a busy slot is free")


class HostHit(NamedTuple):
    """A block of a prefix hit that the host tier (or disk) holds.

    Attributes:
      slot: its host slot (busy this plan).
      tokens: the tokens it adds to the hit: ``block_size`` of them, but for a last one from
        a radix partial match; none for a hybrid cache's (its ``blocks`` entry counts them).
      row: the bytes to load into the slot first when it came from disk, else None.
      key: its prefix key (a hybrid cache's group key, ``group_key``), or None for a radix
        partial block, and for a hybrid cache's disk row loaded into a slot that the hit ended
        before (written, not promoted).
      position: a hybrid cache's logical block (one group's block there), else -1.
    """

    slot: int
    tokens: tuple[int, ...]
    row: np.ndarray | None
    key: Hashable | None
    position: int = -1


def lookup(bm, host: HostTier | None, token_ids: Sequence[int], salt: Hashable):
    """The longest cached prefix of ``token_ids`` over the device pool, then the host tier.

    The device part is ``BlockManager.lookup``; the host part continues the hash chain from its
    last block, block by block, in the host tier and then (with a disk store) on disk, up to
    ``BlockManager.max_hit_blocks``. In radix mode the next block is then the longest partial
    match after the last full hit on either tier (the device's on a tie: a device copy). A
    hybrid cache's groups search both tiers at once (``_lookup_groups``).

    Returns:
      ``(blocks, keys, partial, host_hits)``: the device blocks, the keys of every full hit
      block (device then host), the device radix partial ``(block, k)`` or None, and a
      ``HostHit`` per host block, in the order ``promotions`` fills them. Host slots found
      are busy.
    """
    if host is None or bm.prefix_cache is None:
        return (*bm.lookup(token_ids, salt), ())
    if bm.num_groups > 1:
        return _lookup_groups(bm, host, token_ids, salt)
    blocks, keys, partial = bm.lookup(token_ids, salt)
    bs, pc = bm.block_size, bm.prefix_cache
    parent = keys[-1] if keys else pc.root(salt)
    hits, keys = [], list(keys)
    for j in range(len(blocks), bm.max_hit_blocks(len(token_ids))):
        tokens = tuple(token_ids[j * bs:(j + 1) * bs])
        key = pc.key(parent, tokens)
        found = _find(host, key, Origin(key, 0, parent if j else None, tokens, salt))
        if found is None:
            break
        hits.append(HostHit(found[0], tokens, found[1], key))
        keys.append(parent := key)
    if bm.residual_window_blocks:   # no partial match inside the residual window
        return blocks, tuple(keys), partial, tuple(hits)
    j = len(blocks) + len(hits)
    rest = tuple(token_ids[j * bs:(j + 1) * bs])
    if hits:   # the device's partial match, at the first host hit's position, is void
        partial = pc.partial(parent, rest)
    on_host = host.partial(parent, rest)
    if on_host is not None and (partial is None or on_host[1] > partial[1]):   # device on ties
        hits.append(HostHit(host.find(on_host[0]), rest[:on_host[1]], None, None))
        partial = None
    return blocks, tuple(keys), partial, tuple(hits)


def _find(host: HostTier, key: Hashable, origin: Origin | None = None
          ) -> tuple[int, np.ndarray | None] | None:
    """``(slot, row)`` of prefix block ``key`` on the host (row None), else loaded from disk
    into a slot (row: its bytes), or None."""
    slot = host.find(key)
    return (slot, None) if slot is not None else host.load(key, origin)


def _lookup_groups(bm, host: HostTier, token_ids: Sequence[int], salt: Hashable):
    """``lookup`` of a hybrid cache: ``BlockManager.lookup`` counting the blocks the host
    tier or disk holds, in every group (a slot found is held even when the hit ends before
    it: it stays a host prefix block). Its ``blocks`` are None where the host fills them."""
    found: dict[Hashable, tuple[int, np.ndarray | None]] = {}

    def elsewhere(key: Hashable) -> bool:
        if key not in found and (at := _find(host, key)) is not None:
            found[key] = at
        return key in found

    blocks, keys, _ = bm.lookup(token_ids, salt, elsewhere)
    hits = []
    for hit, g in zip(bm._hits(blocks, keys), range(bm.num_groups)):
        for j in (j for j, b in enumerate(hit) if b is None):
            key = group_key(keys[j], g)
            slot, row = found[key]
            hits.append(HostHit(slot, (), row, key, j))
    # a disk row loaded for a block the hit ends before still fills its slot (key None)
    used = {h.key for h in hits}
    hits += [HostHit(slot, (), row, None) for key, (slot, row) in found.items()
             if row is not None and key not in used]
    return blocks, keys, None, tuple(hits)


def hit_tokens(bm, hits: Sequence[HostHit], disk: bool = False) -> int:
    """Tokens of a prefix hit the host tier (``disk``: the disk) gave: a hybrid cache's count
    a logical block once, whichever groups' blocks there came from the host."""
    hits = [h for h in hits if (h.key is not None or h.position < 0)
            and (not disk or h.row is not None)]
    positions = {h.position for h in hits if h.position >= 0}
    return sum(len(h.tokens) for h in hits) + bm.block_size * len(positions)


def promotions(bm, request_id: Hashable, num_blocks: int, hits: Sequence[HostHit]
               ) -> list[tuple[int, int]]:
    """The swap-ins ``(slot, block)`` filling the fresh blocks ``allocate_cached`` gave the
    host hits of ``request_id``'s prefix (``num_blocks``: its device hit's length): after the
    device blocks, then cached (``register``); a hybrid cache's are cached already, under
    their keys (``BlockManager._promote``)."""
    if bm.num_groups > 1:
        return [(h.slot, bm.prefix_cache.find(h.key)) for h in hits if h.key is not None]
    table = bm.block_table(request_id)
    bm.register(request_id, sum((h.tokens for h in hits), ()))
    return [(h.slot, table[num_blocks + i]) for i, h in enumerate(hits)]


def demote_evictions(bm, host: HostTier) -> list[tuple[int, int, Hashable | None]]:
    """The swap-outs ``(block, slot, key)`` demoting the cached blocks ``bm`` reused this plan
    (``BlockManager.take_evictions``) to ``host``; a radix partial block's ``key`` is None
    (host only, see the module docstring)."""
    ops = []
    for key, block, node in bm.take_evictions():
        op = host.demote(key, block, node,
                         partial=node is not None and len(node[1]) < bm.block_size)
        if op is not None:
            ops.append(op)
    return ops


def _check(condition, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not condition:
        raise AssertionError(message)
