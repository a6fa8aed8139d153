"""The suffix proposer of speculative decoding (``speculative="suffix"``; SuffixDecoding, Oliaro
et al. 2024): prompt lookup over every request the engine has served, not one request alone.

Design notes: docs/speculative-decoding.md."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence

import numpy as np


class _Node:
    """A trie node: the path from the root to it occurs ``count`` times; ``children`` by next
    token."""

    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixProposer:
    """Drafts from a suffix trie of every indexed request's tokens (see the module docstring).

    Args:
      max_depth: the longest substring counted (``>= 2``): the longest suffix matched is one
        token shorter.
      cache_tokens: the most tokens of requests that stopped running kept indexed (the oldest
        leave first; running requests are always indexed).
      min_probability: drafting stops where the draft's estimated probability falls below this
        (in ``[0, 1]``).
    """

    def __init__(self, max_depth: int = 16, cache_tokens: int = 16384,
                 min_probability: float = 0.1):
        if max_depth < 2:
            raise ValueError(f"suffix_max_depth={max_depth} must be >= 2")
        if cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens={cache_tokens} must be >= 0")
        if not 0.0 <= min_probability <= 1.0:
            raise ValueError(f"suffix_min_probability={min_probability} must be in [0, 1]")
        self.max_depth, self.cache_tokens = max_depth, cache_tokens
        self.min_probability = min_probability
        self._root = _Node()
        self._tokens: dict[Hashable, list[int]] = {}   # a running request's indexed tokens
        # the nodes of its paths that end at its last indexed token and may still grow
        # (lengths 1 .. max_depth - 1, shortest first)
        self._open: dict[Hashable, list[_Node]] = {}
        self._cached: deque[list[int]] = deque()   # stopped requests' tokens, oldest first
        self._cached_tokens = 0

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of requests that stopped running still indexed."""
        return self._cached_tokens

    def propose_batch(self, requests: Mapping[Hashable, tuple[np.ndarray, int]]
                      ) -> dict[Hashable, tuple[int, ...]]:
        """``{request_id: up to k drafts}`` for ``{request_id: (token_ids, k)}`` (int32 [L],
        prompt + output so far), after indexing every request's tokens not yet indexed."""
        for request_id, (token_ids, _) in requests.items():
            self._index(request_id, token_ids)
        return {i: self.propose(token_ids, k) for i, (token_ids, k) in requests.items()}

    def propose(self, tokens: Sequence[int], num_drafts: int) -> tuple[int, ...]:
        """Up to ``num_drafts`` drafts after ``tokens`` from the trie as it stands (steps 1-2
        of the module docstring); indexes nothing."""
        tail = [int(t) for t in tokens[-(self.max_depth - 1):]]   # all a match can use
        out: list[int] = []
        probability = 1.0
        node, depth = None, 0
        while len(out) < num_drafts:
            if node is None or depth == self.max_depth:
                node, depth = self._match(tail + out)
                if node is None:
                    break
            if not node.children:
                break
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda tc: (tc[1].count, -tc[0]))
            probability *= child.count / total
            if probability < self.min_probability:
                break
            out.append(token)
            node, depth = child, depth + 1
        return tuple(out)

    def release(self, request_id: Hashable) -> None:
        """Request ``request_id`` stopped running: its tokens join the cache (oldest-out)."""
        tokens = self._tokens.pop(request_id, None)
        self._open.pop(request_id, None)
        if tokens is None:
            return
        self._cached.append(tokens)
        self._cached_tokens += len(tokens)
        while self._cached_tokens > self.cache_tokens:
            old = self._cached.popleft()
            self._cached_tokens -= len(old)
            self._remove(old)

    def _index(self, request_id: Hashable, token_ids: np.ndarray) -> None:
        """Counts the substrings that end in ``request_id``'s tokens (int [L], prompt + output)
        not yet indexed."""
        indexed = self._tokens.setdefault(request_id, [])
        n = len(indexed)
        if len(token_ids) < n or (n and int(token_ids[n - 1]) != indexed[-1]):
            self._remove(indexed)   # not an extension of what was indexed: start again
            indexed.clear()
            self._open[request_id], n = [], 0
        grown = self._open.setdefault(request_id, [])
        for token in np.asarray(token_ids[n:]).tolist():
            nodes = []
            for parent in [self._root, *grown]:   # paths of lengths 0 .. max_depth - 1
                child = parent.children.get(token)
                if child is None:
                    child = parent.children[token] = _Node()
                child.count += 1
                nodes.append(child)
            grown = nodes[:self.max_depth - 1]
            indexed.append(token)
        self._open[request_id] = grown

    def _remove(self, tokens: list[int]) -> None:
        """Uncounts every substring ``_index`` counted for ``tokens``; a node whose count falls
        to 0 is cut off (with it, its subtree: no other path runs through it)."""
        for start in range(len(tokens)):
            node = self._root
            for token in tokens[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    break
                node = child

    def _walk(self, path: Sequence[int]) -> _Node | None:
        node = self._root
        for token in path:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def _match(self, context: list[int]) -> tuple[_Node | None, int]:
        """The node and length of the longest suffix of ``context`` (at most ``max_depth - 1``
        tokens) that occurs followed by some token; (None, 0) when none does."""
        lo, hi, best = 1, min(self.max_depth - 1, len(context)), None
        while lo <= hi:   # "present with children" holds for every length up to the longest
            mid = (lo + hi) // 2
            node = self._walk(context[len(context) - mid:])
            if node is not None and node.children:
                best, lo = (node, mid), mid + 1
            else:
                hi = mid - 1
        return best if best is not None else (None, 0)
