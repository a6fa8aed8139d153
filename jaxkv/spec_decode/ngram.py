"""The n-gram proposer of speculative decoding (``speculative="ngram"``; prompt lookup, Saxena
2023, vLLM's ``ngram``).

    proposer = NgramProposer(min_n=1, max_n=4)
    proposer.propose(np.array([5, 6, 7, 9, 5, 6], np.int32), 2)   # -> (7, 9)

Find the longest suffix of a request's tokens (prompt + output so far), ``n`` from ``max_n``
down to ``min_n``, that also occurs earlier in them, and propose the tokens that followed its
most recent earlier occurrence. Host-side numpy, no model, no state: a ``Proposer`` of
jaxkv/spec_decode/speculator.py. Its drafts are point masses, which the rejection sampler
(jaxkv/sample/rejection.py) verifies exactly.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Prompt lookup: the tokens after the most recent earlier occurrence of the longest
    matching suffix.

    Args:
      min_n, max_n: the suffix lengths tried (``1 <= min_n <= max_n``).
    """

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes min_n={min_n}, max_n={max_n} need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: np.ndarray, num_drafts: int) -> tuple[int, ...]:
        """Up to ``num_drafts`` tokens that followed the suffix earlier (see the class).

        Every earlier position ``p`` holding the last token (and followed by at least one token)
        is a candidate; its match is extended backwards while it equals the suffix, up to
        ``max_n`` tokens: O(L + candidates x max_n) numpy work.
        """
        a = np.asarray(token_ids)
        length = len(a)
        ends = np.flatnonzero(a[:-1] == a[-1]) if length > 1 else np.zeros(0, np.int64)
        if num_drafts < 1 or ends.size == 0:
            return ()
        matched = np.ones(ends.size, np.int64)   # [C] suffix tokens matched ending at ends
        for t in range(1, min(self.max_n, length)):
            grow = (matched == t) & (ends >= t)
            grow[grow] = a[ends[grow] - t] == a[length - 1 - t]
            if not grow.any():
                break
            matched += grow
        best = matched.max()
        if best < self.min_n:
            return ()
        p = ends[np.flatnonzero(matched == best)[-1]]   # the most recent of the longest
        return tuple(a[p + 1:p + 1 + num_drafts].tolist())
