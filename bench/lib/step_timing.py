"""Host vs device time of one engine step: the measurement bench/decode_step.py and the
end-to-end rows of bench/gpu_check.py share (the experiments take the load average and the
alternating timings from here too).

``runner.device_time`` grows by the seconds from a step's jitted dispatch until its tokens are on
the host (jaxkv/runner/model_runner.py). The step is synchronous (its tokens are read back before
``llm.step()`` returns), so nothing of the host's work overlaps it: the rest of the step's wall
time is host work on the critical path (scheduling, ``batch.build``, the sampling tensors, the
bookkeeping and detokenization of the emitted tokens). The dispatch's own Python cost lies inside
the device interval, so the host share is, if anything, under-counted.

No jax or jaxkv import here: bench/gpu_check.py imports this module before it knows whether the
engine's imports are available.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Callable


def loadavg() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (recorded beside every measurement)."""
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the time and the 1-minute load."""
    print(f"[{time.strftime('%H:%M:%S')} load {loadavg()[0]:.2f}] {msg}", file=sys.stderr,
          flush=True)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One ``llm.step()``: its wall and device seconds, its kind and what it returned."""

    wall_s: float
    device_s: float
    decode: bool        # no prefill in the step: nothing waiting, every running prompt computed
    outputs: list       # llm.step()'s RequestOutputs

    @property
    def host_s(self) -> float:
        return self.wall_s - self.device_s

    @property
    def host_share(self) -> float:
        """Fraction of the step's wall time not spent inside the jitted device step."""
        return self.host_s / self.wall_s


def alternating_times(calls: dict[str, Callable[[], object]], rounds: int,
                      repeats: int) -> dict[str, list[float]]:
    """Seconds of every call of each variant: ``repeats`` back-to-back calls of one variant,
    then the next, for ``rounds`` rounds (against load drift). Each call must block until its
    result is ready (``jax.block_until_ready``)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(repeats):
                t = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t)
    return times


def ms_summary(seconds: list[float]) -> dict[str, float]:
    """``{"ms_median", "ms_min"}`` of a list of seconds."""
    return {"ms_median": 1e3 * statistics.median(seconds), "ms_min": 1e3 * min(seconds)}


def decoding(llm) -> bool:
    """Whether ``llm``'s next step decodes only: no request waits and every running one has
    computed its whole prompt (read from the engine's immutable scheduler state)."""
    state = llm.engine.scheduler_state
    return not state.waiting and all(
        state.requests[r].num_computed_tokens >= len(state.requests[r].request.prompt_token_ids)
        for r in state.running)


def timed_step(llm) -> StepTime:
    """Runs one ``llm.step()`` and returns its wall and device seconds."""
    decode = decoding(llm)
    runner = llm.engine.runner
    d0, t = runner.device_time, time.perf_counter()
    outputs = llm.step()
    wall = time.perf_counter() - t
    return StepTime(wall, runner.device_time - d0, decode, outputs)
