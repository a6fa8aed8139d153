"""BlockManager: host-side owner of the paged KV pool's blocks (numpy, no jax).

Design notes: docs/scheduling.md."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from jaxkv.blocks.prefix_cache import PrefixCache, lookup, make_prefix_cache

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
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: str | None = None,
                 residual_window_blocks: int = 0):
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
        self._tables: dict[Hashable, tuple[int, ...]] = {}
        self.prefix_cache: PrefixCache | None = make_prefix_cache(prefix_caching, block_size)
        self.residual_window_blocks = residual_window_blocks
        # per request: (root key, keys of its leading registered full blocks...)
        self._chains: dict[Hashable, tuple[Hashable, ...]] = {}
        self.record_evictions = False   # the host tier (jaxkv/blocks/host_tier.py) wants them
        self._evicted: list[tuple[Hashable, int]] = []
        self._copy_sources: list[int] = []   # radix copy sources held until the plan ends

    def copy(self) -> BlockManager:
        """An independent copy (the arrays are copied, the immutable tables shared)."""
        new = object.__new__(BlockManager)
        new.num_blocks = self.num_blocks
        new.block_size = self.block_size
        new._next = self._next.copy()
        new._prev = self._prev.copy()
        new._ref = self._ref.copy()
        new._num_free = self._num_free
        new._tables = dict(self._tables)
        new.prefix_cache = None if self.prefix_cache is None else self.prefix_cache.copy()
        new.residual_window_blocks = self.residual_window_blocks
        new._chains = dict(self._chains)
        new.record_evictions = self.record_evictions
        new._evicted = list(self._evicted)
        new._copy_sources = list(self._copy_sources)
        return new

    # ---- queries ---------------------------------------------------------------------------

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
        """Physical block ids of ``request_id``, logical block order."""
        if request_id not in self._tables:
            raise ValueError(f"request_id={request_id!r} has no block table")
        return self._tables[request_id]

    def free_block_ids(self) -> tuple[int, ...]:
        """The free queue, head (next to be allocated) first. O(num_free_blocks)."""
        out = []
        block = int(self._next[NULL_BLOCK])
        while block != NULL_BLOCK and len(out) <= self._num_free:  # bounded even if corrupt
            out.append(block)
            block = int(self._next[block])
        return tuple(out)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new table for ``num_tokens`` tokens fits in the free blocks."""
        return self.blocks_for(num_tokens) <= self._num_free

    def can_append_slots(self, request_id: Hashable, new_total_tokens: int,
                         write_from: int | None = None) -> bool:
        """Whether ``request_id``'s table can grow to hold ``new_total_tokens`` tokens (and, when
        writing from position ``write_from``, copy a shared block there first)."""
        missing = self.blocks_for(new_total_tokens) - len(self.block_table(request_id))
        if write_from is not None and self.needs_copy(request_id, write_from):
            missing += 1
        return missing <= self._num_free

    def needs_copy(self, request_id: Hashable, position: int) -> bool:
        """Whether writing ``position`` would write into a block another table references."""
        table = self.block_table(request_id)
        j = position // self.block_size
        return j < len(table) and self._ref[table[j]] > 1

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (referenced or not); 0 without prefix caching."""
        return 0 if self.prefix_cache is None else len(self.prefix_cache)

    def ref_count(self, block: int) -> int:
        return int(self._ref[block])

    def lookup(self, token_ids: Sequence[int], salt: Hashable = None):
        """Longest cached prefix of ``token_ids`` (a prompt but its last token):
        ``(blocks, keys, partial)`` as ``prefix_cache.lookup``, cut before the residual window
        (see the class docstring); nothing without prefix caching."""
        if self.prefix_cache is None:
            return (), (), None
        blocks, keys, partial = lookup(self.prefix_cache, token_ids, salt)
        if not self.residual_window_blocks:
            return blocks, keys, partial
        n = self.max_hit_blocks(len(token_ids))   # the window after the prompt starts there
        return blocks[:n], keys[:n], None

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

    def can_allocate_cached(self, num_tokens: int, blocks: Sequence[int],
                            partial: tuple[int, int] | None, *, reserve: int = 0) -> bool:
        """Whether ``allocate_cached(.., num_tokens, blocks, .., partial)`` fits with
        ``reserve`` free blocks to spare."""
        need = self.blocks_for(num_tokens) - len(blocks)
        need += sum(self._ref[b] == 0 for b in blocks)
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
        host tier; with ``partial = (src, k)`` the block after those is a fresh copy of ``src``,
        which stays held until ``release_copy_sources``. Returns ``(table, copy)`` with
        ``copy = (src, dst)`` or None::

            table   [ b3 | h1 | d  | n1 | n2 ]   b3 cached (shared), h1 promoted, d n1.. fresh
                      ^    ^    ^ copy of src (first k tokens valid), computing resumes there
        """
        if request_id in self._tables:
            raise ValueError(f"request_id={request_id!r} already has a block table")
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        if not self.can_allocate_cached(num_tokens, blocks, partial):
            raise ValueError(f"num_tokens={num_tokens} needs "
                             f"{self.blocks_for(num_tokens) - len(blocks)} more blocks but only "
                             f"{self._num_free} are free")
        for b in blocks:
            self._acquire(b)
        if partial is not None:   # held until release_copy_sources(), see there
            self._acquire(partial[0])
            self._copy_sources.append(partial[0])
        new = self._take(self.blocks_for(num_tokens) - len(blocks), "num_tokens", num_tokens)
        copy = None if partial is None else (partial[0], new[promoted])
        self._tables[request_id] = tuple(blocks) + new
        if self.prefix_cache is not None:
            self._chains[request_id] = (self.prefix_cache.root(salt), *keys)
        return self._tables[request_id], copy

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
        need = sum(kept) + max(0, self.blocks_for(num_tokens) - len(kept))
        return need + reserve <= self._num_free

    def allocate_layout(self, request_id: Hashable, kept: Sequence[bool], num_tokens: int, *,
                        salt: Hashable = None) -> tuple[int, ...]:
        """Create the table of a request coming back from the host tier (swap preemption):
        logical block ``j < len(kept)`` gets a fresh block where ``kept[j]`` (filled by a
        swap-in before the step), the null block where its retention policy had dropped it,
        and fresh blocks follow up to ``num_tokens`` tokens. Its blocks are registered in the
        prefix cache afresh (``register``), under ``salt``."""
        if request_id in self._tables:
            raise ValueError(f"request_id={request_id!r} already has a block table")
        if len(kept) > self.blocks_for(num_tokens):
            raise ValueError(f"num_tokens={num_tokens} fits in {self.blocks_for(num_tokens)} "
                             f"blocks but kept has {len(kept)}")
        if not self.can_allocate_layout(kept, num_tokens):
            raise ValueError(f"num_tokens={num_tokens} needs more blocks than the "
                             f"{self._num_free} free ones")
        fresh = iter(self._take(sum(kept) + self.blocks_for(num_tokens) - len(kept),
                                "num_tokens", num_tokens))
        self._tables[request_id] = tuple(next(fresh) if k else NULL_BLOCK for k in kept) \
            + tuple(fresh)
        if self.prefix_cache is not None:
            self._chains[request_id] = (self.prefix_cache.root(salt),)
        return self._tables[request_id]

    def append_slots(self, request_id: Hashable, new_total_tokens: int) -> tuple[int, ...]:
        """Grow ``request_id``'s table to hold ``new_total_tokens`` tokens; returns the table.

        A no-op when the table already has room. Raises ``ValueError`` (and changes nothing)
        when the free blocks do not suffice.
        """
        table = self.block_table(request_id)
        missing = self.blocks_for(new_total_tokens) - len(table)
        if missing > 0:
            table += self._take(missing, "new_total_tokens", new_total_tokens)
            self._tables[request_id] = table
        return table

    def truncate(self, request_id: Hashable, num_tokens: int) -> tuple[int, ...]:
        """Shrink ``request_id``'s table to the ``blocks_for(num_tokens)`` blocks that hold its
        first ``num_tokens`` (>= 1) tokens; returns the table. A no-op when it is no longer.

        Speculative decoding rewinds with it: the blocks only rejected draft tokens needed
        (fresh from ``append_slots``, unshared, uncached) go back to the *head* of the free
        queue in reverse table order, so the queue is again as it was before they were taken.

        Raises:
          ValueError: ``num_tokens < 1``, or a dropped block is registered in the prefix cache.
        """
        table = self.block_table(request_id)
        keep = self.blocks_for(num_tokens)
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        if self.num_registered(request_id) > keep:
            raise ValueError(f"request_id={request_id!r}: truncating to {keep} blocks would drop "
                             f"{self.num_registered(request_id) - keep} registered blocks")
        for block in reversed(table[keep:]):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._push_head(block)
        self._tables[request_id] = table[:keep]
        return self._tables[request_id]

    def release_blocks(self, request_id: Hashable, logical: Sequence[int]) -> int:
        """Give back the logical blocks ``logical`` of ``request_id`` that a retention policy
        dropped (jaxkv/retention/), in that order: each table entry becomes the null block and
        the block loses one reference (joining the free queue as ``free`` would put it there
        once unreferenced; a block another table shares stays theirs). Entries already dropped
        are skipped. Returns how many were released.

        The table keeps its length: logical block ``j`` still covers positions
        ``[j * block_size, (j + 1) * block_size)``, and attention never sees a null entry.
        """
        table = list(self.block_table(request_id))
        released = 0
        for j in logical:
            if table[j] != NULL_BLOCK:
                self._release(table[j])
                table[j] = NULL_BLOCK
                released += 1
        if released:
            self._tables[request_id] = tuple(table)
        return released

    def free(self, request_id: Hashable, partial_tokens: Sequence[int] = ()) -> None:
        """Drop ``request_id``'s table; blocks whose ref count reaches 0 join the free queue in
        reverse table order (tail blocks are reused first): at the tail when cached, else at the
        head. ``partial_tokens``: the computed tokens of a partially filled last block, which
        radix mode caches when no other table shares it."""
        table = self.block_table(request_id)
        chain = self._chains.pop(request_id, None)
        if (partial_tokens and chain is not None and len(chain) == len(table)
                and self._ref[table[-1]] == 1 and table[-1] not in self.prefix_cache):
            self.prefix_cache.insert(chain[-1], tuple(partial_tokens), table[-1])
        for block in reversed(table):
            if block != NULL_BLOCK:   # dropped by a retention policy
                self._release(block)
        del self._tables[request_id]

    def fork(self, parent_id: Hashable, child_id: Hashable,
             num_blocks: int | None = None) -> tuple[int, ...]:
        """Give ``child_id`` the first ``num_blocks`` (default all) blocks of ``parent_id``
        (shared, ref counts + 1)."""
        table = self.block_table(parent_id)[:num_blocks]
        if child_id in self._tables:
            raise ValueError(f"child_id={child_id!r} already has a block table")
        for block in table:
            if block != NULL_BLOCK:
                self._ref[block] += 1
        self._tables[child_id] = table
        if parent_id in self._chains:
            self._chains[child_id] = self._chains[parent_id][:len(table) + 1]
        return table

    def copy_on_write(self, request_id: Hashable, position: int) -> tuple[int, int] | None:
        """Before ``request_id`` writes ``position``: if that block is shared, replace it by a
        fresh block and return the ``(src, dst)`` copy to apply on device; else None."""
        if not self.needs_copy(request_id, position):
            return None
        table = self._tables[request_id]
        j = position // self.block_size
        (dst,) = self._take(1, "position", position)
        src = table[j]
        self._ref[src] -= 1   # still > 0: another table holds it
        self._tables[request_id] = table[:j] + (dst,) + table[j + 1:]
        return src, dst

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
        table = self._tables[request_id]
        bs = self.block_size
        first = len(chain) - 1
        for i in range(len(token_ids) // bs):
            if table[first + i] == NULL_BLOCK:   # dropped before it was registered
                break
            key = self.prefix_cache.insert(chain[-1], tuple(token_ids[i * bs:(i + 1) * bs]),
                                           table[first + i])
            if key is None:
                break
            chain += (key,)
        self._chains[request_id] = chain

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks keep their owners; live requests re-register their
        filled blocks on their next ``register``)."""
        if self.prefix_cache is None:
            return
        self.prefix_cache = make_prefix_cache(self.prefix_cache.mode, self.block_size)
        self._chains = {r: c[:1] for r, c in self._chains.items()}

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
        for request_id, table in self._tables.items():
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
        for request_id, chain in self._chains.items():
            _check(request_id in self._tables, f"request {request_id!r}: chain without table")
            _check(len(chain) - 1 <= len(self._tables[request_id]),
                   f"request {request_id!r}: more registered blocks than blocks")


def _check(condition, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not condition:
        raise AssertionError(message)
