"""Prefix cache: which KV blocks hold which token prefixes (host only, no jax).

Design notes: docs/scheduling.md."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

from jaxkv.config.scheduler import PREFIX_CACHING_MODES

T = TypeVar("T")


class PrefixCache:
    """The interface both modes implement (hash-mode behaviour where they agree).

    Args:
      block_size: tokens per block.
    """

    mode = "hash"

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._block_of: dict[Hashable, int] = {}   # key -> cached block
        self._key_of: dict[int, Hashable] = {}     # cached block -> key

    def copy(self) -> PrefixCache:
        new = object.__new__(type(self))
        new.__dict__.update({k: dict(v) if isinstance(v, dict) else v
                             for k, v in self.__dict__.items()})
        return new

    def __contains__(self, block: int) -> bool:
        return block in self._key_of

    def __len__(self) -> int:
        """Number of cached blocks."""
        return len(self._key_of)

    def is_partial(self, block: int) -> bool:
        """Whether ``block`` is cached holding fewer than ``block_size`` tokens (radix only)."""
        return False

    def root(self, salt: Hashable) -> Hashable:
        """Key of the (virtual) parent of a request's first block: a 64-bit digest of the
        salt's ``repr``, the same in every process (the persistent cache,
        jaxkv/kvcache/disk_store.py, finds a restarted engine's blocks by these keys)."""
        digest = hashlib.blake2b(repr(("jaxkv-prefix-root", salt)).encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little", signed=True)

    @staticmethod
    def key(parent: Hashable, tokens: tuple[int, ...]) -> int:
        """The key of the block after ``parent`` holding ``tokens`` (CPython's tuple hash of
        ints: deterministic across processes, unlike a hash of str)."""
        return hash((parent, tokens))

    def find(self, key: Hashable) -> int | None:
        """The block cached under ``key``, or None."""
        return self._block_of.get(key)

    def insert_alias(self, key: Hashable, block: int) -> None:
        """Cache ``block`` under ``key`` as a leaf of no tree (a hybrid cache's group block,
        keyed by ``group_key``); a no-op when either is cached already."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def key_of_block(self, block: int) -> Hashable:
        """The key ``block`` is cached under."""
        return self._key_of[block]

    def node(self, block: int) -> tuple[Hashable, tuple[int, ...]] | None:
        """``(parent key, tokens)`` of cached ``block`` in radix mode (what a partial match
        reads); None in hash mode."""
        return None

    def full_blocks(self) -> tuple[tuple[Hashable, int], ...]:
        """``(key, block)`` of every cached full block."""
        return tuple((k, b) for b, k in self._key_of.items() if not self.is_partial(b))

    def child(self, parent: Hashable, tokens: tuple[int, ...]) -> tuple[int, Hashable] | None:
        """``(block, key)`` of the cached full block after ``parent`` holding ``tokens``."""
        key = self.key(parent, tokens)
        block = self._block_of.get(key)
        return None if block is None else (block, key)

    def partial(self, parent: Hashable, tokens: tuple[int, ...]) -> tuple[int, int] | None:
        """``(block, k)``: a cached block after ``parent`` whose first ``k >= 1`` tokens equal
        ``tokens[:k]`` (longest such ``k``); None in hash mode."""
        return None

    def insert(self, parent: Hashable, tokens: tuple[int, ...], block: int) -> Hashable | None:
        """Register ``block``, whose K/V for ``tokens`` is computed, after ``parent``.

        Returns the key under which this prefix is cached: ``block``'s new key, or the key of a
        block already cached for the same prefix (which stays the cached one). None when nothing
        can be cached: a partial block in hash mode, or an unknown parent in radix mode.
        """
        if len(tokens) != self.block_size:
            return None
        key = self.key(parent, tokens)
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key
        return key

    def evict(self, block: int) -> tuple[int, ...]:
        """Forget ``block`` (about to be reused); returns every block no longer cached."""
        del self._block_of[self._key_of.pop(block)]
        return (block,)

    def check(self, num_blocks: int) -> None:
        """Raise ``AssertionError`` unless the maps are mutually inverse over valid block ids."""
        _check(len(self._block_of) == len(self._key_of), "prefix maps differ in size")
        for block, key in self._key_of.items():
            _check(1 <= block < num_blocks, f"cached block {block} outside [1, {num_blocks})")
            _check(self._block_of.get(key) == block, f"cached block {block}: key maps elsewhere")


class RadixPrefixCache(PrefixCache):
    """Radix mode: hash mode plus a child index per key and partial blocks.

    The tree is the hash chain itself (a node's key is its content hash, so an evicted node that
    is computed again gets its old key back and its cached children become reachable again, as in
    hash mode); the child index lets ``partial`` match a child token by token.
    """

    mode = "radix"

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self._tokens: dict[int, tuple[int, ...]] = {}          # cached block -> its tokens
        self._parent: dict[int, Hashable] = {}                 # cached block -> parent key
        self._children: dict[Hashable, tuple[int, ...]] = {}   # parent key -> child blocks

    def is_partial(self, block: int) -> bool:
        """Whether ``block`` is cached holding fewer than ``block_size`` tokens."""
        return block in self._tokens and len(self._tokens[block]) < self.block_size

    def node(self, block):
        return (self._parent[block], self._tokens[block]) if block in self._tokens else None

    def partial(self, parent, tokens):
        return longest_match(((b, self._tokens[b]) for b in self._children.get(parent, ())),
                             tokens)

    def insert(self, parent, tokens, block):
        key = self.key(parent, tokens)
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key
            self._tokens[block] = tokens
            self._parent[block] = parent
            self._children[parent] = self._children.get(parent, ()) + (block,)
        return key if len(tokens) == self.block_size else None

    def evict(self, block):
        if block in self._tokens:   # not an alias
            parent = self._parent.pop(block)
            siblings = tuple(b for b in self._children.pop(parent) if b != block)
            if siblings:
                self._children[parent] = siblings
            del self._tokens[block]
        return super().evict(block)

    def check(self, num_blocks):
        super().check(num_blocks)
        _check(set(self._tokens) == set(self._parent) <= set(self._key_of),
               "radix token / parent maps != cached blocks")
        index: dict[Hashable, list[int]] = {}
        for block, tokens in self._tokens.items():
            _check(1 <= len(tokens) <= self.block_size, f"block {block}: bad token count")
            _check(self._key_of[block] == self.key(self._parent[block], tokens),
                   f"block {block}: key is not the hash of (parent, tokens)")
            index.setdefault(self._parent[block], []).append(block)
        _check({p: sorted(c) for p, c in index.items()}
               == {p: sorted(c) for p, c in self._children.items()}, "radix child index broken")


def longest_match(candidates: Iterable[tuple[T, tuple[int, ...]]], tokens: Sequence[int]
                  ) -> tuple[T, int] | None:
    """``(c, k)``: of the ``(c, cached tokens)`` candidates, the first whose cached tokens share
    the longest common start ``k >= 1`` with ``tokens``; None when none shares a first token."""
    best = None
    for c, cached in candidates:
        k = 0
        while k < min(len(cached), len(tokens)) and cached[k] == tokens[k]:
            k += 1
        if k and (best is None or k > best[1]):
            best = (c, k)
    return best


def group_key(key: Hashable, group: int) -> Hashable:
    """The key of hybrid cache group ``group``'s block whose group-0 key is ``key`` (group 0:
    ``key`` itself), as vLLM's ``BlockHashWithGroupId``."""
    return key if group == 0 else hash((key, group))


def make_prefix_cache(mode: str | None, block_size: int) -> PrefixCache | None:
    """The prefix cache of ``mode`` (``"hash"``, ``"radix"``), or None when ``mode`` is None."""
    if mode is None:
        return None
    if mode not in PREFIX_CACHING_MODES:
        raise ValueError(f"prefix_caching={mode!r} is not one of {PREFIX_CACHING_MODES} or None")
    return (RadixPrefixCache if mode == "radix" else PrefixCache)(block_size)


def lookup(cache: PrefixCache, token_ids: Sequence[int], salt: Hashable
           ) -> tuple[tuple[int, ...], tuple[Hashable, ...], tuple[int, int] | None]:
    """Longest cached prefix of ``token_ids``.

    Returns:
      ``(blocks, keys, partial)``: the cached full blocks covering ``token_ids[:len(blocks) *
      block_size]`` and their keys, then ``partial = (block, k)`` when (radix mode) a cached block
      also holds the next ``k`` tokens (``1 <= k < block_size``, bounded by ``len(token_ids)``).
    """
    bs = cache.block_size
    key = cache.root(salt)
    blocks, keys = [], []
    for start in range(0, len(token_ids) - bs + 1, bs):
        hit = cache.child(key, tuple(token_ids[start:start + bs]))
        if hit is None:
            break
        blocks.append(hit[0])
        keys.append(key := hit[1])
    rest = tuple(token_ids[len(blocks) * bs:len(blocks) * bs + bs])
    partial = cache.partial(key, rest) if rest else None  # k < bs: a full match was taken above
    return tuple(blocks), tuple(keys), partial


def _check(condition, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not condition:
        raise AssertionError(message)
