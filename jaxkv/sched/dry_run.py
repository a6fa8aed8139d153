"""The step shapes a known workload steps through: the engine's scheduler run alone, without the
model, so that a benchmark compiles those shapes and no others (``LLM.warmup(shapes)``).

Each sequence samples a fixed token and runs to its ``max_tokens`` (eos ignored), so the plans
are the real run's as long as the scheduler decides by lengths: the prompts' prefix-cache hits
are found alike, and a block with generated tokens never matches another request's.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.sched import scheduler
from jaxkv.sched.state import Request, StopSpec, init_state


def step_shapes(cache_config: CacheConfig, sched_config: SchedulerConfig,
                requests: Sequence[tuple[Sequence[int], int]]) -> set[tuple[int, int]]:
    """The padded ``(T, S)`` of every step an engine of these configs runs for ``requests``,
    ``(prompt token ids, max_tokens)`` pairs queued at once, in order, that ignore eos.

    Raises:
      ValueError: a request that cannot fit (``scheduler.add_request``).
    """
    state = init_state(cache_config)
    for i, (ids, max_tokens) in enumerate(requests):
        stop = StopSpec(max_tokens=int(max_tokens), ignore_eos=True)
        state = scheduler.add_request(state, Request(
            request_id=i, prompt_token_ids=ids, stop=stop, arrival_time=i), sched_config)
    shapes = set()
    while state.requests:
        state, plan = scheduler.schedule(state, sched_config)
        if plan.seqs:
            shapes.add(sched_config.padded_shape(plan.num_tokens, len(plan.seqs)))
        state = scheduler.update(state, plan, [0] * len(plan.seqs))
    return shapes
