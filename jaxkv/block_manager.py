"""BlockManager: host-side owner of the paged KV pool's blocks (numpy, no jax).

It is the single source of truth for who owns which block: a free queue, a reference count per
block, and one block table (logical block -> physical block id) per request. The device never
allocates; it only reads the tables the scheduler copies into each step's plan.

Block 0 is the null block. It is never allocated, never freed and never appears in a block table:
padding tokens write their K/V into it and padded block-table entries point at it, so every device
index stays inside the pool while nothing real ever reads it. Here it doubles as the sentinel of the
free queue, a circular doubly linked list threaded through two int32 arrays:

    next_[0] -> first free block        prev_[0] -> last free block
    free queue 5 <-> 6 <-> 7 <-> 2 <-> 1, held as:

        block   0  1  2  3  4  5  6  7
        next_   5  0  1  -  -  6  7  2       ('-' = -1: block in use)
        prev_   1  2  7  -  -  0  5  6
        ref     0  0  0  1  2  0  0  0

Allocation pops from the head; ``free`` appends a table's blocks to the tail in *reverse* order.
Freed blocks are therefore reused last (least recently freed first), and among one table's blocks
the tail is reused before the head. That is the LRU eviction order the prefix cache will need
(vLLM's free queue): a freed block keeps its K/V until reused, and a prompt's head blocks are the
ones most likely to be shared. The linked list (rather than a deque) lets the prefix cache later
take a cached block out of the middle of the queue in O(1).

Forking shares blocks: ``fork`` gives the child the parent's table and increments every ref count.
The last, partially filled block then has two writers; copy-on-write (a future ``ensure_writable``
that copies such a block before a request appends to it) and the prefix-hash map come later.

Copying is cheap and is how the pure scheduler treats a BlockManager as a value: ``copy`` duplicates
three int32 [num_blocks] arrays and a dict whose block tables are immutable tuples shared between
copies (see jaxkv/scheduler.py). Mutating methods change only ``self``.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class BlockManager:
    """Free queue, ref counts and per-request block tables of a pool of ``num_blocks`` blocks.

    Args:
      num_blocks: blocks in the pool including the null block 0 (``>= 2``).
      block_size: tokens per block (``>= 1``).
    """

    def __init__(self, num_blocks: int, block_size: int):
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

    def can_append_slots(self, request_id: Hashable, new_total_tokens: int) -> bool:
        """Whether ``request_id``'s table can grow to hold ``new_total_tokens`` tokens."""
        missing = self.blocks_for(new_total_tokens) - len(self.block_table(request_id))
        return missing <= self._num_free

    # ---- mutations -------------------------------------------------------------------------

    def allocate(self, request_id: Hashable, num_tokens: int) -> tuple[int, ...]:
        """Create the block table of a new request, holding ``num_tokens`` (>= 1) tokens."""
        if request_id in self._tables:
            raise ValueError(f"request_id={request_id!r} already has a block table")
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens} must be >= 1")
        self._tables[request_id] = self._take(self.blocks_for(num_tokens), "num_tokens", num_tokens)
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

    def free(self, request_id: Hashable) -> None:
        """Drop ``request_id``'s table; blocks whose ref count reaches 0 join the free queue's
        tail in reverse table order (tail blocks are reused first)."""
        for block in reversed(self.block_table(request_id)):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._push_tail(block)
        del self._tables[request_id]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> tuple[int, ...]:
        """Give ``child_id`` the same blocks as ``parent_id`` (shared, ref counts + 1)."""
        table = self.block_table(parent_id)
        if child_id in self._tables:
            raise ValueError(f"child_id={child_id!r} already has a block table")
        for block in table:
            self._ref[block] += 1
        self._tables[child_id] = table
        return table

    def _take(self, n: int, field: str, value: int) -> tuple[int, ...]:
        """Pop ``n`` blocks from the head of the free queue, each with ref count 1."""
        if n > self._num_free:
            raise ValueError(f"{field}={value} needs {n} more blocks but only "
                             f"{self._num_free} are free")
        blocks = []
        for _ in range(n):
            block = int(self._next[NULL_BLOCK])
            after = self._next[block]
            self._next[NULL_BLOCK] = after
            self._prev[after] = NULL_BLOCK
            self._next[block] = self._prev[block] = -1
            self._ref[block] = 1
            blocks.append(block)
        self._num_free -= n
        return tuple(blocks)

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

        Checks: every block id in a table lies in ``[1, num_blocks)``; each ref count equals the
        number of table entries naming that block; the free queue is a well-linked list holding
        exactly the blocks with ref count 0 other than the null block, each once; the null
        block is never free, never referenced.
        """
        counts = np.zeros(self.num_blocks, np.int64)  # [num_blocks]
        for request_id, table in self._tables.items():
            ids = np.asarray(table, np.int64)
            _check(np.all((ids >= 1) & (ids < self.num_blocks)),
                   f"request {request_id!r}: block ids out of [1, {self.num_blocks}): {table}")
            np.add.at(counts, ids, 1)
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


def _check(condition, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not condition:
        raise AssertionError(message)
