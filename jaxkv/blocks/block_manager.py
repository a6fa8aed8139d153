"""BlockManager: host-side owner of the paged KV pool's blocks (numpy, no jax).

Design notes: docs/scheduling.md."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from jaxkv.blocks.kv_events import GPU, Cleared, Origin, Removed, Stored, record
from jaxkv.blocks.prefix_cache import PrefixCache, group_key, lookup, make_prefix_cache

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class BlockManager:
    """Free queue, ref counts and per-request block tables of a pool of ``num_blocks`` blocks.

    Args:
      num_blocks: blocks in the pool including the null block 0 (``>= 2``).
      block_size: tokens per block (``>= 1``).
      prefix_caching: ``"hash"``, ``"radix"`` or None (no prefix cache).
      residual_window_blocks: the KIVI residual window R of an int4/int2 cache, or 0. A cached
        block holds codes only, so a hit must not put one inside the new request's window:
        ``lookup`` then stops before the prompt's last R - 1 full blocks and matches no partial
        block (those are recomputed, and land in the full-precision residual as they would
        without the cache).
      windows: the hybrid cache's groups (``jaxkv.config.kv_groups.KVGroups.windows``): per
        group its sliding window or None (full attention). Each request has one table per
        group, all of one length; a sliding group's entries below its window are the null
        block (``release_window``). Group 0 is the one ``block_table`` and retention policies
        see; a prefix hit is one every group can serve (``lookup``).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: str | None = None,
                 residual_window_blocks: int = 0, windows: Sequence[int | None] = (None,)):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        ids = np.arange(num_blocks, dtype=np.int32)
        self._next = np.roll(ids, -1)  # [num_blocks] free-queue successor, -1 when in use
        self._prev = np.roll(ids, 1)   # [num_blocks] free-queue predecessor, -1 when in use
        self._ref = np.zeros(num_blocks, np.int32)  # [num_blocks] table references per block
        self._num_free = num_blocks - 1
        self.windows = tuple(windows)
        self._tables: dict[Hashable, tuple[tuple[int, ...], ...]] = {}   # per group
        self.prefix_cache: PrefixCache | None = make_prefix_cache(prefix_caching, block_size)
        self.residual_window_blocks = residual_window_blocks
        # per request: (root key, keys of its leading registered full blocks...)
        self._chains: dict[Hashable, tuple[Hashable, ...]] = {}
        self._salts: dict[Hashable, Hashable] = {}   # per request with a chain: its cache salt
        self.kv_events: list | None = None   # cache transitions (jaxkv/blocks/kv_events.py)
        self.record_evictions = False   # the host tier (jaxkv/blocks/host_tier.py) wants them
        self._evicted: list[tuple[Hashable, int]] = []
        self._copy_sources: list[int] = []   # radix copy sources held until the plan ends

    def copy(self) -> BlockManager:
        """An independent copy (the arrays are copied, the immutable tables shared)."""
        new = object.__new__(BlockManager)
        new.num_blocks = self.num_blocks
        new.block_size = self.block_size
        new.windows = self.windows
        new._next = self._next.copy()
        new._prev = self._prev.copy()
        new._ref = self._ref.copy()
        new._num_free = self._num_free
        new._tables = dict(self._tables)
        new.prefix_cache = None if self.prefix_cache is None else self.prefix_cache.copy()
        new.residual_window_blocks = self.residual_window_blocks
        new._chains = dict(self._chains)
        new._salts = dict(self._salts)
        new.kv_events = None if self.kv_events is None else list(self.kv_events)
        new.record_evictions = self.record_evictions
        new._evicted = list(self._evicted)
        new._copy_sources = list(self._copy_sources)
        return new

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) that are in use."""
        return 1.0 - self._num_free / (self.num_blocks - 1)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._tables

    def request_ids(self) -> tuple[Hashable, ...]:
        """Ids of the requests that own a block table, in allocation order."""
        return tuple(self._tables)

    def block_table(self, request_id: Hashable) -> tuple[int, ...]:
        """Physical block ids of ``request_id`` (group 0), logical block order."""
        return self.block_tables(request_id)[0]

    def block_tables(self, request_id: Hashable) -> tuple[tuple[int, ...], ...]:
        """``request_id``'s table of every group (one length), logical block order."""
        if request_id not in self._tables:
            raise ValueError(f"request_id={request_id!r} has no block table")
        return self._tables[request_id]

    def flat_table(self, request_id: Hashable) -> tuple[int, ...]:
        """Every group's table, one after the other (what a swap moves)."""
        return sum(self.block_tables(request_id), ())

    def blocks_per_group(self) -> tuple[int, ...]:
        """Distinct blocks the tables of each group hold (shared ones once)."""
        return tuple(len({b for tables in self._tables.values() for b in tables[g]}
                         - {NULL_BLOCK}) for g in range(self.num_groups))

    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue, head (next to be allocated) first. O(num_free_blocks)."""
        out = []
        block = int(self._next[NULL_BLOCK])
        while block != NULL_BLOCK and len(out) <= self._num_free:  # bounded even if corrupt
            out.append(block)
            block = int(self._next[block])
        return tuple(out)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether new tables for ``num_tokens`` tokens fit in the free blocks."""
        return self.num_groups * self.blocks_for(num_tokens) <= self._num_free

    def can_append_slots(self, request_id: Hashable, new_total_tokens: int,
                         write_from: int | None = None) -> bool:
        """Whether ``request_id``'s table can grow to hold ``new_total_tokens`` tokens (and, when
        writing from position ``write_from``, copy a shared block there first)."""
        missing = self.blocks_for(new_total_tokens) - len(self.block_table(request_id))
        missing = self.num_groups * max(0, missing)
        if write_from is not None:
            missing += len(self._shared(request_id, write_from))
        return missing <= self._num_free

    def needs_copy(self, request_id: Hashable, position: int) -> bool:
        """Whether writing ``position`` would write into a block another table references."""
        return bool(self._shared(request_id, position))

    def _shared(self, request_id: Hashable, position: int) -> list[int]:
        """The groups whose block at ``position`` another table references too."""
        j = position // self.block_size
        return [g for g, table in enumerate(self.block_tables(request_id))
                if j < len(table) and self._ref[table[j]] > 1]

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (referenced or not); 0 without prefix caching."""
        return 0 if self.prefix_cache is None else len(self.prefix_cache)

    def ref_count(self, block: int) -> int:
        return int(self._ref[block])

    def lookup(self, token_ids: Sequence[int], salt: Hashable = None,
               elsewhere: Callable[[Hashable], bool] | None = None):
        """Longest cached prefix of ``token_ids`` (a prompt but its last token):
        ``(blocks, keys, partial)`` as ``prefix_cache.lookup``, cut before the residual window
        (see the class docstring); nothing without prefix caching. A hybrid cache's lookup
        also counts the blocks ``elsewhere(key)`` finds (the host tier): their entries are
        None, and ``allocate_cached`` gives them fresh blocks."""
        if self.prefix_cache is None:
            return (), (), None
        if self.num_groups > 1:
            return self._lookup_groups(token_ids, salt, elsewhere)
        blocks, keys, partial = lookup(self.prefix_cache, token_ids, salt)
        if not self.residual_window_blocks:
            return blocks, keys, partial
        n = self.max_hit_blocks(len(token_ids))   # the window after the prompt starts there
        return blocks[:n], keys[:n], None

    def _lookup_groups(self, token_ids: Sequence[int], salt: Hashable,
                       elsewhere: Callable[[Hashable], bool] | None):
        """``lookup`` over hybrid groups: the most whole blocks every group can serve (a full
        group needs all of them, a sliding one those its window reaches back to from the next
        query), shrunk until no group objects, as vLLM's coordinator does. Group 0's blocks
        (null below a window, None where ``elsewhere`` holds it) and the keys; never a
        partial block."""
        pc, bs = self.prefix_cache, self.block_size
        keys, parent = [], pc.root(salt)
        for j in range(self.max_hit_blocks(len(token_ids))):
            keys.append(parent := pc.key(parent, tuple(token_ids[j * bs:(j + 1) * bs])))

        def has(j: int, g: int) -> bool:
            key = group_key(keys[j], g)
            return pc.find(key) is not None or (elsewhere is not None and elsewhere(key))

        h = len(keys)
        for g in (g for g, w in enumerate(self.windows) if w is None):
            h = next((j for j in range(h) if not has(j, g)), h)
        before = -1
        while h != before:
            before = h
            for g in (g for g, w in enumerate(self.windows) if w is not None):
                h = self._window_hit(has, g, h)
        return self._hits((), keys[:h])[0], tuple(keys[:h]), None

    def window_kept(self, request_id: Hashable, position: int, num_blocks: int) -> bool:
        """Whether every sliding group of ``request_id`` still holds its first ``num_blocks``
        blocks from the window of a query at ``position`` on (what a fork there needs)."""
        return all(NULL_BLOCK not in t[self.window_start(g, position):num_blocks]
                   for g, t in enumerate(self.block_tables(request_id))
                   if self.windows[g] is not None)

    def window_start(self, g: int, position: int) -> int:
        """First logical block group ``g``'s window needs for a query at ``position``."""
        w = self.windows[g]
        return 0 if w is None else max(0, (position - w + 1) // self.block_size)

    def _window_hit(self, has: Callable[[int, int], bool], g: int, h: int) -> int:
        """The longest hit of at most ``h`` blocks sliding group ``g`` serves: block ``j`` of
        it is cached where ``has(j, g)``, and every block from its window's start must be (a
        hit ending past a missing block cannot)."""
        while h > 0:
            missing = [j for j in range(self.window_start(g, h * self.block_size), h)
                       if not has(j, g)]
            if not missing:
                return h
            h = missing[-1]
        return 0

    def _hits(self, blocks: Sequence[int], keys: Sequence[Hashable]
              ) -> tuple[tuple[int | None, ...], ...]:
        """Per group, the cached blocks of a hit (hybrid: found by ``keys``, null below a
        window, None where the device lacks one: the host tier holds it; one group:
        ``blocks``)."""
        if self.num_groups == 1:
            return (tuple(blocks),)
        h, pc = len(keys), self.prefix_cache
        return tuple(tuple(NULL_BLOCK if j < self.window_start(g, h * self.block_size) else
                           pc.find(group_key(keys[j], g)) for j in range(h))
                     for g in range(self.num_groups))

    def max_hit_blocks(self, num_tokens: int) -> int:
        """Most full blocks a prefix hit of a ``num_tokens``-token lookup may cover: its full
        blocks, stopping before the residual window (see the class docstring)."""
        n = num_tokens // self.block_size
        if self.residual_window_blocks:
            n = min(n, max(0, (num_tokens + 1) // self.block_size
                           - (self.residual_window_blocks - 1)))
        return n

    def take_evictions(self) -> tuple[tuple[Hashable, int, tuple | None], ...]:
        """The ``(key, block, node)`` of every cached block reused since the last call (with
        ``record_evictions``), oldest first: the block still holds that key's KV until the
        step that reuses it runs. ``node``: ``PrefixCache.node`` (radix mode: its parent key and
        tokens, partial blocks included unless there is a residual window; hash mode: None)."""
        out, self._evicted = tuple(self._evicted), []
        return out

    def take_kv_events(self) -> list:
        """The KV-cache event records since the last call, oldest first (the engine drains
        them each step; none while ``kv_events`` is None)."""
        out = self.kv_events or []
        if self.kv_events is not None:
            self.kv_events = []
        return out

    def can_allocate_cached(self, num_tokens: int, blocks: Sequence[int],
                            partial: tuple[int, int] | None, *, reserve: int = 0,
                            keys: Sequence[Hashable] = ()) -> bool:
        """Whether ``allocate_cached(.., num_tokens, blocks, keys, partial)`` fits with
        ``reserve`` free blocks to spare."""
        hits = self._hits(blocks, keys)
        need = self.num_groups * (self.blocks_for(num_tokens) - len(hits[0]))
        need += sum(b is None or self._ref[b] == 0 for hit in hits for b in hit
                    if b != NULL_BLOCK)
        if partial is not None and self._ref[partial[0]] == 0:
            need += 1  # held until the plan ends (release_copy_sources)
        return need + reserve <= self._num_free

    # ---- mutations -------------------------------------------------------------------------

    def allocate(self, request_id: Hashable, num_tokens: int, *,
                 salt: Hashable = None) -> tuple[int, ...]:
        """Create the block table of a new request, holding ``num_tokens`` (>= 1) tokens; its
        filled blocks will be cached under ``salt``."""
        return self.allocate_cached(request_id, num_tokens, (), (), None, salt=salt)[0]

    def allocate_cached(self, request_id: Hashable, num_tokens: int, blocks: Sequence[int],
                        keys: Sequence[Hashable], partial: tuple[int, int] | None, *,
                        salt: Hashable = None, promoted: int = 0
                        ) -> tuple[tuple[int, ...], tuple[int, int] | None]:
        """Create a table of ``num_tokens`` tokens starting with the cached ``blocks`` (a
        ``lookup`` result, shared), then ``promoted`` fresh blocks the caller fills from the
        host tier (a hybrid hit's host blocks are its None entries instead, see ``_promote``);
        with ``partial = (src, k)`` the block after those is a fresh copy of ``src``, which
        stays held until ``release_copy_sources``. Returns ``(table, copy)`` with
        ``copy = (src, dst)`` or None::

            table   [ b3 | h1 | d  | n1 | n2 ]   b3 cached (shared), h1 promoted, d n1.. fresh
                      ^    ^    ^ copy of src (first k tokens valid), computing resumes there
        """
        if request_id in self._tables:
            raise ValueError(f"request_id={request_id!r} already has a block table")
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        if not self.can_allocate_cached(num_tokens, blocks, partial, keys=keys):
            need = self.num_groups * (self.blocks_for(num_tokens) - len(blocks))
            raise ValueError(f"num_tokens={num_tokens} needs {need} more blocks but only "
                             f"{self._num_free} are free")
        hits = self._hits(blocks, keys)
        for b in (b for hit in hits for b in hit if b not in (NULL_BLOCK, None)):
            self._acquire(b)
        if partial is not None:   # held until release_copy_sources(), see there
            self._acquire(partial[0])
            self._copy_sources.append(partial[0])
        tables = tuple(self._promote(hit, keys, g) + self._take(
            self.blocks_for(num_tokens) - len(hit), "num_tokens", num_tokens)
            for g, hit in enumerate(hits))
        copy = None if partial is None else (partial[0], tables[0][len(blocks) + promoted])
        self._tables[request_id] = tables
        if self.prefix_cache is not None:
            self._chains[request_id] = (self.prefix_cache.root(salt), *keys)
            self._salts[request_id] = salt
        return tables[0], copy

    def _promote(self, hit: Sequence[int | None], keys: Sequence[Hashable], g: int
                 ) -> tuple[int, ...]:
        """Group ``g``'s hit with a fresh block for each entry the host tier holds (None),
        cached under its key: the caller fills it by a swap-in before the step that reads it
        (``jaxkv.blocks.host_tier.promotions``)."""
        out = []
        for j, b in enumerate(hit):
            if b is None:
                (b,) = self._take(1, "num_tokens", len(hit) * self.block_size)
                self._insert_alias(group_key(keys[j], g), b)
            out.append(b)
        return tuple(out)

    def release_copy_sources(self) -> None:
        """Give back the radix copy sources ``allocate_cached`` held (call it once the plan's
        allocations are done). Until then no allocation can take such a block: a swap-in of the
        same plan, which the runner applies before the block copies, would overwrite the source
        before its copy reads it."""
        for block in self._copy_sources:
            self._release(block)
        self._copy_sources = []

    def can_allocate_layout(self, kept: Sequence[bool], num_tokens: int, *,
                            reserve: int = 0) -> bool:
        """Whether ``allocate_layout(.., kept, num_tokens)`` fits with ``reserve`` free blocks
        to spare."""
        per_group = len(kept) // self.num_groups
        need = sum(kept) + self.num_groups * max(0, self.blocks_for(num_tokens) - per_group)
        return need + reserve <= self._num_free

    def allocate_layout(self, request_id: Hashable, kept: Sequence[bool], num_tokens: int, *,
                        salt: Hashable = None) -> tuple[int, ...]:
        """Create the tables of a request coming back from the host tier (swap preemption):
        ``kept`` is every group's layout one after the other (``flat_table``'s order); logical
        block ``j`` gets a fresh block where kept (filled by a swap-in before the step), the
        null block where its retention policy or window had dropped it, and fresh blocks
        follow up to ``num_tokens`` tokens. Returns the block of each entry of ``kept``, in its
        order (where the swap-ins go); the blocks are registered in the prefix cache afresh
        (``register``), under ``salt``."""
        if request_id in self._tables:
            raise ValueError(f"request_id={request_id!r} already has a block table")
        m = len(kept) // self.num_groups
        if m > self.blocks_for(num_tokens) or m * self.num_groups != len(kept):
            raise ValueError(f"num_tokens={num_tokens} fits in {self.blocks_for(num_tokens)} "
                             f"blocks per group but kept has {len(kept)} for "
                             f"{self.num_groups} groups")
        if not self.can_allocate_layout(kept, num_tokens):
            raise ValueError(f"num_tokens={num_tokens} needs more blocks than the "
                             f"{self._num_free} free ones")
        fresh = iter(self._take(sum(kept) + self.num_groups * (self.blocks_for(num_tokens) - m),
                                "num_tokens", num_tokens))
        tail = self.blocks_for(num_tokens) - m
        self._tables[request_id] = tuple(
            tuple(next(fresh) if k else NULL_BLOCK for k in kept[g * m:(g + 1) * m])
            + tuple(next(fresh) for _ in range(tail)) for g in range(self.num_groups))
        if self.prefix_cache is not None:
            self._chains[request_id] = (self.prefix_cache.root(salt),)
            self._salts[request_id] = salt
        return sum((t[:m] for t in self._tables[request_id]), ())

    def append_slots(self, request_id: Hashable, new_total_tokens: int) -> tuple[int, ...]:
        """Grow ``request_id``'s table to hold ``new_total_tokens`` tokens; returns the table.

        A no-op when the table already has room. Raises ``ValueError`` (and changes nothing)
        when the free blocks do not suffice.
        """
        tables = self.block_tables(request_id)
        missing = self.blocks_for(new_total_tokens) - len(tables[0])
        if missing > 0:
            if self.num_groups * missing > self._num_free:
                raise ValueError(f"new_total_tokens={new_total_tokens} needs "
                                 f"{self.num_groups * missing} more blocks but only "
                                 f"{self._num_free} are free")
            tables = tuple(t + self._take(missing, "new_total_tokens", new_total_tokens)
                           for t in tables)
            self._tables[request_id] = tables
        return tables[0]

    def truncate(self, request_id: Hashable, num_tokens: int) -> tuple[int, ...]:
        """Shrink ``request_id``'s table to the ``blocks_for(num_tokens)`` blocks that hold its
        first ``num_tokens`` (>= 1) tokens; returns the table. A no-op when it is no longer.

        Speculative decoding rewinds with it: the blocks only rejected draft tokens needed
        (fresh from ``append_slots``, unshared, uncached) go back to the *head* of the free
        queue in reverse table order, so the queue is again as it was before they were taken.

        Raises:
          ValueError: ``num_tokens < 1``, or a dropped block is registered in the prefix cache.
        """
        tables = self.block_tables(request_id)
        keep = self.blocks_for(num_tokens)
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        if self.num_registered(request_id) > keep:
            raise ValueError(f"request_id={request_id!r}: truncating to {keep} blocks would drop "
                             f"{self.num_registered(request_id) - keep} registered blocks")
        for block in (b for t in reversed(tables) for b in reversed(t[keep:])):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._push_head(block)
        self._tables[request_id] = tuple(t[:keep] for t in tables)
        return self._tables[request_id][0]

    def release_blocks(self, request_id: Hashable, logical: Sequence[int]) -> int:
        """Give back the logical blocks ``logical`` of ``request_id`` that a retention policy
        dropped (jaxkv/retention/), in that order: each table entry becomes the null block and
        the block loses one reference (joining the free queue as ``free`` would put it there
        once unreferenced; a block another table shares stays theirs). Entries already dropped
        are skipped. Returns how many were released.

        The table keeps its length: logical block ``j`` still covers positions
        ``[j * block_size, (j + 1) * block_size)``, and attention never sees a null entry.
        """
        return self._release_entries(request_id, 0, logical)

    def release_window(self, request_id: Hashable, num_computed: int) -> int:
        """Give back every sliding group's blocks below the window of a query at
        ``num_computed`` (as ``release_blocks``, walking down to the first null entry).
        Returns how many were released."""
        released = 0
        for g, table in enumerate(self.block_tables(request_id)):
            if self.windows[g] is None:
                continue
            stop = min(len(table), self.window_start(g, num_computed))
            drops = []
            for j in range(stop - 1, -1, -1):
                if table[j] == NULL_BLOCK:
                    break
                drops.append(j)
            released += self._release_entries(request_id, g, drops)
        return released

    def _release_entries(self, request_id: Hashable, g: int, logical: Sequence[int]) -> int:
        """Null group ``g``'s entries ``logical`` of ``request_id`` (one reference less each)."""
        tables = self.block_tables(request_id)
        table = list(tables[g])
        released = 0
        for j in logical:
            if table[j] != NULL_BLOCK:
                self._release(table[j])
                table[j] = NULL_BLOCK
                released += 1
        if released:
            self._tables[request_id] = tables[:g] + (tuple(table),) + tables[g + 1:]
        return released

    def free(self, request_id: Hashable, partial_tokens: Sequence[int] = ()) -> None:
        """Drop ``request_id``'s table; blocks whose ref count reaches 0 join the free queue in
        reverse table order (tail blocks are reused first): at the tail when cached, else at the
        head. ``partial_tokens``: the computed tokens of a partially filled last block, which
        radix mode caches when no other table shares it."""
        tables = self.block_tables(request_id)
        table = tables[0]
        chain = self._chains.pop(request_id, None)
        self._salts.pop(request_id, None)
        if (partial_tokens and chain is not None and len(chain) == len(table)
                and self.num_groups == 1
                and self._ref[table[-1]] == 1 and table[-1] not in self.prefix_cache):
            self.prefix_cache.insert(chain[-1], tuple(partial_tokens), table[-1])
        for block in (b for t in reversed(tables) for b in reversed(t)):
            if block != NULL_BLOCK:   # dropped by a retention policy or a window
                self._release(block)
        del self._tables[request_id]

    def fork(self, parent_id: Hashable, child_id: Hashable,
             num_blocks: int | None = None) -> tuple[int, ...]:
        """Give ``child_id`` the first ``num_blocks`` (default all) blocks of ``parent_id``
        (shared, ref counts + 1)."""
        tables = tuple(t[:num_blocks] for t in self.block_tables(parent_id))
        if child_id in self._tables:
            raise ValueError(f"child_id={child_id!r} already has a block table")
        for block in (b for t in tables for b in t):
            if block != NULL_BLOCK:
                self._ref[block] += 1
        self._tables[child_id] = tables
        if parent_id in self._chains:
            self._chains[child_id] = self._chains[parent_id][:len(tables[0]) + 1]
            self._salts[child_id] = self._salts.get(parent_id)
        return tables[0]

    def copy_on_write(self, request_id: Hashable, position: int) -> tuple[tuple[int, int], ...]:
        """Before ``request_id`` writes ``position``: every group's block there that another
        table shares is replaced by a fresh block; returns the ``(src, dst)`` copies to apply
        on device (none when nothing is shared)."""
        shared = self._shared(request_id, position)
        if len(shared) > self._num_free:
            raise ValueError(f"position={position} needs {len(shared)} more blocks but only "
                             f"{self._num_free} are free")
        tables = list(self._tables[request_id])
        j = position // self.block_size
        ops = []
        for g in shared:
            (dst,) = self._take(1, "position", position)
            src = tables[g][j]
            self._ref[src] -= 1   # still > 0: another table holds it
            tables[g] = tables[g][:j] + (dst,) + tables[g][j + 1:]
            ops.append((src, dst))
        self._tables[request_id] = tuple(tables)
        return tuple(ops)

    def num_registered(self, request_id: Hashable) -> int:
        """Leading full blocks of ``request_id`` already registered in the prefix cache."""
        chain = self._chains.get(request_id)
        return 0 if chain is None else len(chain) - 1

    def register(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Cache ``request_id``'s next full blocks, whose K/V is computed.

        ``token_ids``: the tokens of blocks ``num_registered(request_id)`` onward (whole blocks;
        a trailing partial block is ignored). A no-op without prefix caching.
        """
        chain = self._chains.get(request_id)
        if chain is None:
            return
        tables, pc = self._tables[request_id], self.prefix_cache
        bs = self.block_size
        first = len(chain) - 1
        salt = self._salts.get(request_id)
        for i in range(len(token_ids) // bs):
            tokens, j = tuple(token_ids[i * bs:(i + 1) * bs]), first + i
            parent = None if j == 0 else chain[-1]   # an event's parent: none for the first
            if self.num_groups > 1:   # every group's block under its own key (null: none)
                key = pc.key(chain[-1], tokens)
                for g, table in enumerate(tables):
                    if table[j] != NULL_BLOCK:
                        self._insert_alias(group_key(key, g), table[j],
                                           Origin(key, g, parent, tokens, salt))
            elif tables[0][j] == NULL_BLOCK:   # dropped before it was registered
                break
            else:
                fresh = self.kv_events is not None and tables[0][j] not in pc
                if (key := pc.insert(chain[-1], tokens, tables[0][j])) is None:
                    break
                if fresh and pc.find(key) == tables[0][j]:   # newly cached: an event
                    record(self.kv_events, Stored(GPU, key, Origin(key, 0, parent, tokens, salt)))
            chain += (key,)
        self._chains[request_id] = chain

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks keep their owners; live requests re-register their
        filled blocks on their next ``register``)."""
        if self.prefix_cache is None:
            return
        self.prefix_cache = make_prefix_cache(self.prefix_cache.mode, self.block_size)
        self._chains = {r: c[:1] for r, c in self._chains.items()}
        record(self.kv_events, Cleared())

    def _insert_alias(self, key: Hashable, block: int, origin: Origin | None = None) -> None:
        """``prefix_cache.insert_alias``, recording the store when it is new."""
        pc = self.prefix_cache
        fresh = pc.find(key) is None and block not in pc
        pc.insert_alias(key, block)
        if fresh:
            record(self.kv_events, Stored(GPU, key, origin))

    def _acquire(self, block: int) -> None:
        """One more reference to ``block`` (taken out of the free queue if it was free)."""
        if self._ref[block] == 0:
            before, after = self._prev[block], self._next[block]
            self._next[before] = after
            self._prev[after] = before
            self._next[block] = self._prev[block] = -1
            self._num_free -= 1
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        """One reference less; at 0 the block joins the free queue: at the tail if it is cached
        full, else (uncached, or a cached partial block: cheap to recompute) at the head."""
        self._ref[block] -= 1
        if self._ref[block] == 0:
            pc = self.prefix_cache
            if pc is not None and (block not in pc or pc.is_partial(block)):
                self._push_head(block)
            else:
                self._push_tail(block)

    def _take(self, n: int, field: str, value: int) -> tuple[int, ...]:
        """Pop ``n`` blocks from the head of the free queue, each with ref count 1."""
        if n > self._num_free:
            raise ValueError(f"{field}={value} needs {n} more blocks but only "
                             f"{self._num_free} are free")
        blocks = []
        for _ in range(n):
            block = int(self._next[NULL_BLOCK])
            pc = self.prefix_cache
            if pc is not None and block in pc:
                # a partial block is never matched under a residual window: not worth keeping
                if self.record_evictions and not (pc.is_partial(block)
                                                  and self.residual_window_blocks):
                    self._evicted.append((pc.key_of_block(block), block, pc.node(block)))
                record(self.kv_events, Removed(GPU, pc.key_of_block(block)))
                pc.evict(block)
            after = self._next[block]
            self._next[NULL_BLOCK] = after
            self._prev[after] = NULL_BLOCK
            self._next[block] = self._prev[block] = -1
            self._ref[block] = 1
            blocks.append(block)
        self._num_free -= n
        return tuple(blocks)

    def _push_head(self, block: int) -> None:
        first = self._next[NULL_BLOCK]
        self._prev[first] = block
        self._next[block] = first
        self._prev[block] = NULL_BLOCK
        self._next[NULL_BLOCK] = block
        self._num_free += 1

    def _push_tail(self, block: int) -> None:
        last = self._prev[NULL_BLOCK]
        self._next[last] = block
        self._prev[block] = last
        self._next[block] = NULL_BLOCK
        self._prev[NULL_BLOCK] = block
        self._num_free += 1

    # ---- checking --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` unless the pool is consistent.

        Checks: every block id in a table lies in ``[1, num_blocks)``, or is the null block of
        an entry a retention policy dropped; each ref count equals the number of table entries
        naming that block (plus one per held copy source); the free queue is a well-linked list
        holding exactly the blocks with ref count 0 other than the null block, each once; the
        null block is never free, never referenced; the prefix cache's maps are consistent, and only
        requests with a table have a chain, no longer than their table.
        """
        counts = np.zeros(self.num_blocks, np.int64)  # [num_blocks]
        for request_id, tables in self._tables.items():
            _check(len(tables) == self.num_groups and len({len(t) for t in tables}) == 1,
                   f"request {request_id!r}: not one table per group, all of one length")
            for table in tables:
                ids = np.asarray(table, np.int64)
                _check(np.all((ids >= 0) & (ids < self.num_blocks)),
                       f"request {request_id!r}: block ids out of [0, {self.num_blocks}): {table}")
                np.add.at(counts, ids, 1)
        np.add.at(counts, np.asarray(self._copy_sources, np.int64), 1)
        counts[NULL_BLOCK] = 0   # dropped entries (retention) reference no block
        _check(np.array_equal(counts, self._ref), "ref counts differ from table references")
        free = self.free_block_ids()
        _check(len(free) == self._num_free,
               f"free queue holds {len(free)} blocks, num_free_blocks={self._num_free}")
        _check(len(set(free)) == len(free), "a block appears twice in the free queue")
        _check(NULL_BLOCK not in free, "the null block is in the free queue")
        unreferenced = set(np.flatnonzero(self._ref == 0).tolist()) - {NULL_BLOCK}
        _check(set(free) == unreferenced, "free queue != blocks with ref count 0")
        for block in free:
            _check(self._next[self._prev[block]] == block, f"free queue broken at block {block}")
        in_use = self._ref > 0  # [num_blocks]
        _check(np.all(self._next[in_use] == -1) and np.all(self._prev[in_use] == -1),
               "a block in use is still linked into the free queue")
        if self.prefix_cache is not None:
            self.prefix_cache.check(self.num_blocks)
            _check(NULL_BLOCK not in self.prefix_cache, "the null block is cached")
        _check(self._salts.keys() == self._chains.keys(), "salts and chains differ")
        for request_id, chain in self._chains.items():
            _check(request_id in self._tables, f"request {request_id!r}: chain without table")
            _check(len(chain) - 1 <= len(self._tables[request_id][0]),
                   f"request {request_id!r}: more registered blocks than blocks")


def _check(condition, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not condition:
        raise AssertionError(message)
