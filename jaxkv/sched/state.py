"""The scheduler's values: a request as submitted (``Request``, ``StopSpec``), its progress
(``RequestState``) and the whole immutable ``SchedulerState``, with the policy key that orders
its queues. Pure Python: no jax (docs/scheduling.md)."""

from __future__ import annotations

import bisect
import dataclasses
import types
from collections.abc import Hashable, Mapping

import numpy as np

from jaxkv.blocks.block_manager import BlockManager
from jaxkv.blocks.host_tier import HostTier, SwapCostModel
from jaxkv.config import CacheConfig

FINISH_STOP = "stop"      # stop token, eos, or the engine's stop string
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_ABORT = "abort"    # abort()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopSpec:
    """When a request stops generating.

    Attributes:
      max_tokens: most tokens to generate (>= 1).
      min_tokens: stop and eos tokens are ignored until this many tokens are generated.
      stop_token_ids: tokens that end generation (the token is kept in the output).
      ignore_eos: keep generating through ``eos_token_ids``.
      eos_token_ids: the model's end-of-sequence tokens.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens="
                             f"{self.max_tokens}]")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """A generation request as submitted.

    Attributes:
      request_id: any hashable id, unique among live requests.
      prompt_token_ids: the prompt (non-empty).
      stop: stopping rule.
      arrival_time: FCFS order (and the priority tie-break).
      priority: lower number = more urgent (used by the ``"priority"`` policy).
      cache_salt: prefix-cache namespace; requests share cached blocks only with equal salts.
      fork_of: id of a request with the same prompt whose prompt blocks this one shares
        (parallel sampling); it should be added after it.
    """

    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    stop: StopSpec = StopSpec()
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: Hashable = None
    fork_of: Hashable = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of request {self.request_id!r} must not be empty")


@dataclasses.dataclass(frozen=True)
class RequestState:
    """A request and its progress.

    Attributes:
      request: as submitted.
      order: position in ``add_request`` order (the last tie-break of the policy key).
      output_token_ids: generated tokens.
      num_computed_tokens: tokens whose K/V is (being) written to the cache.
      finish_reason: None while live, else ``"stop"``, ``"length"`` or ``"abort"``.
      num_cached_tokens: tokens taken from the prefix cache or a fork at the first admission.
      num_skipped: times a later request was admitted before this waiting one (``lpm``).
      num_draft_tokens: draft tokens planned by the last ``schedule`` and not yet verified by
        ``update``; ``num_computed_tokens`` counts them, so it may exceed ``num_tokens`` by this.
      block_scores: f64 [blocks so far] attention mass each logical block received, summed
        over the steps since admission (policies with ``Retention.observe``; else None).
      first_drop: with a history-dependent policy (H2O), the position of the next query when
        the request first dropped a block: only blocks below it are registered in the prefix
        cache (their KV is a function of the tokens alone).
      swapped_tokens: > 0 while the request waits swapped out (swap preemption): the computed
        tokens whose blocks the host tier holds (``HostTier.swapped``); it resumes there.
      num_preemptions: times it was preempted (by recompute or swap).
    """

    request: Request
    order: int
    output_token_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_skipped: int = 0
    num_draft_tokens: int = 0
    block_scores: np.ndarray | None = dataclasses.field(default=None, compare=False)
    first_drop: int | None = None
    swapped_tokens: int = 0
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens ``[start, stop)`` of prompt + output."""
        prompt = self.request.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):stop - len(prompt)]
        return prompt[start:] + self.output_token_ids[:stop - len(prompt)]


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    """Everything the scheduler knows. Never mutated; every function returns a new one.

    Attributes:
      block_manager: block ownership; tables exist exactly for the running requests.
      requests: live (waiting or running) requests by id.
      cache: the settings fixed for the engine's life (``CacheConfig``): the pool, the KV
        retention policy (which blocks ``schedule`` gives back before allocating, how many a
        request may hold; jaxkv/retention/), the preemption mode and whether the pool's
        blocks swap exactly (not KIVI). Everything else here changes from step to step.
      waiting: ids without blocks, most urgent first (policy key order).
      running: ids with blocks, most urgent first (policy key order).
      finished: requests finished or aborted since the last ``schedule``, by id.
      num_added: requests added so far (the next ``RequestState.order``).
      host: the host KV tier (jaxkv/blocks/host_tier.py): demoted prefix blocks and swapped-out
        sequences; None without one.
      cost: the swap-or-recompute cost model ``"auto"`` decides by; the engine refits it from
        its measurements (``with_cost_model``).
    """

    block_manager: BlockManager
    requests: Mapping[Hashable, RequestState]
    cache: CacheConfig
    waiting: tuple[Hashable, ...] = ()
    running: tuple[Hashable, ...] = ()
    finished: Mapping[Hashable, RequestState] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))
    num_added: int = 0
    host: HostTier | None = None
    cost: SwapCostModel | None = None


def init_state(cache_config: CacheConfig, disk=None, kv_events: bool = False
               ) -> SchedulerState:
    """An empty scheduler state over a fresh pool of ``cache_config.num_blocks`` blocks (and a
    host tier of ``cache_config.host_blocks``, with ``disk``, a
    ``jaxkv.kvcache.disk_store.DiskKVStore``, behind it); with ``kv_events`` (and a prefix
    cache) the block owners record their cache transitions (jaxkv/blocks/kv_events.py)."""
    bm = BlockManager(cache_config.num_blocks, cache_config.block_size,
                      cache_config.prefix_caching, cache_config.residual_window_blocks,
                      cache_config.kv_groups.windows)
    kv_events = kv_events and bm.prefix_cache is not None
    bm.kv_events = [] if kv_events else None
    host = None
    if cache_config.host_blocks:
        host = HostTier(cache_config.host_blocks, disk)
        host.kv_events = [] if kv_events else None
        bm.record_evictions = bm.prefix_cache is not None
    return SchedulerState(bm, types.MappingProxyType({}), cache_config, host=host)


def with_cost_model(state: SchedulerState, cost: SwapCostModel) -> SchedulerState:
    """``state`` deciding swap or recompute by ``cost`` from now on."""
    return dataclasses.replace(state, cost=cost)


def policy_key(rs: RequestState, policy: str) -> tuple:
    """Urgency under ``policy``: lower = more urgent (FCFS and LPM: arrival, then add order)."""
    if policy == "priority":
        return (rs.request.priority, rs.request.arrival_time, rs.order)
    return (rs.request.arrival_time, rs.order)


def insert_by_key(queue: list, request_id: Hashable, requests: Mapping, policy: str) -> None:
    """Insert into a key-sorted id list, after equal keys."""
    keys = [policy_key(requests[i], policy) for i in queue]
    queue.insert(bisect.bisect_right(keys, policy_key(requests[request_id], policy)), request_id)
