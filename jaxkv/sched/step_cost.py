"""The step-time model: what one engine step costs on the device, by the shape it pads to.

Design notes: docs/scheduling.md."""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv.config import SchedulerConfig
from jaxkv.config.shapes import pad_step

_EMA = 0.3   # weight of a new duration in a key's moving average


class StepCostModel:
    """Device seconds per step by padded shape (see the module docstring).

    Args:
      token_buckets, seq_buckets, decode_buckets: the scheduler config's buckets (strictly
        increasing).
      refresh: observations after which a key's time is stale.

    Attributes:
      token_buckets, seq_buckets, decode_buckets: as given.
      num_observations: durations observed so far (every key, the dropped ones included).
      total_s: their sum, in seconds.
    """

    def __init__(self, token_buckets: Sequence[int], seq_buckets: Sequence[int],
                 decode_buckets: Sequence[int] = (), *, refresh: int = 256):
        self.token_buckets, self.seq_buckets = tuple(token_buckets), tuple(seq_buckets)
        self.decode_buckets = tuple(decode_buckets)
        self.refresh = refresh
        self.num_observations = 0
        self.total_s = 0.0
        self._time: dict[tuple[int, int, bool], float] = {}   # key -> EMA seconds
        self._seen: dict[tuple[int, int, bool], int] = {}     # key -> index of its last duration
        self._tried: dict[tuple[int, int, bool], int] = {}    # key -> index when last asked for
        self._warm = False   # every shape compiled: a key's first duration is kept

    @classmethod
    def for_scheduler(cls, sc: SchedulerConfig, **kwargs) -> StepCostModel:
        """The model of the steps ``sc`` pads (its token, sequence and decode buckets)."""
        return cls(sc.token_buckets, sc.seq_buckets, sc.decode_buckets, **kwargs)

    def compiled(self) -> None:
        """Notes that every padded shape has been compiled (``ModelRunner.warmup``): from now
        on a key's first duration is kept, so one step measures a shape."""
        self._warm = True

    def key(self, num_tokens: int, num_seqs: int, drafts: bool) -> tuple[int, int, bool]:
        """The padded shape ``(T, S, drafts)`` of a step of ``num_tokens`` tokens (drafts
        included) over ``num_seqs`` sequences (a step with drafts has more tokens than
        sequences: never a decode bucket)."""
        return (*pad_step(self.token_buckets, self.seq_buckets,
                          () if drafts else self.decode_buckets, num_tokens, num_seqs),
                bool(drafts))

    def observe(self, num_tokens: int, num_seqs: int, drafts: bool, seconds: float) -> bool:
        """Records one step's measured device time; returns whether it was kept (False for the
        first of each key, which is dropped, until ``compiled``)."""
        key = self.key(num_tokens, num_seqs, drafts)
        kept = self._warm or key in self._seen
        if kept:
            old = self._time.get(key)
            self._time[key] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds
        self._seen[key] = self.num_observations
        self.num_observations += 1
        self.total_s += seconds
        return kept

    def predict(self, num_tokens: int, num_seqs: int, drafts: bool) -> float | None:
        """The expected device seconds of such a step; None until its padded shape has been
        measured (twice before ``compiled``: the first holds the compilation)."""
        return self._time.get(self.key(num_tokens, num_seqs, drafts))

    def wants(self, num_tokens: int, num_seqs: int, drafts: bool) -> bool:
        """Whether this shape should be measured: it has no time yet or its time is stale, and
        it was not asked for (``tried``) since its last duration within ``refresh``
        observations (a shape a step could not reach is not asked for again at once)."""
        key, now = self.key(num_tokens, num_seqs, drafts), self.num_observations
        seen = self._seen.get(key)
        if key in self._time and now - seen <= self.refresh:
            return False
        tried = self._tried.get(key)
        return tried is None or now - tried > self.refresh or (seen is not None and seen >= tried)

    def tried(self, num_tokens: int, num_seqs: int, drafts: bool) -> None:
        """Notes that a step was planned to measure this shape."""
        self._tried[self.key(num_tokens, num_seqs, drafts)] = self.num_observations
