"""Data-parallel replicas: independent engines over the rows of a ``{"dp": M, "tp": N}`` mesh.

    mesh (M = 2, N = 4)      dp row 0: devices 0 1 2 3  ->  LLM replica 0 (its own params, cache,
                             dp row 1: devices 4 5 6 7  ->  LLM replica 1  scheduler and step)

Construct it explicitly (``LLM(data_parallel_size=M)`` refuses M > 1 and points here).
``generate`` spreads prompts round-robin (prompt i to replica ``i % M``), runs the replicas in
parallel threads (jax releases the GIL while a step runs) and gathers the outputs in input order.
Replicas share nothing, so a request's tokens are exactly what one engine would produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax

from jaxkv.config.kv_events import KVEventsConfig
from jaxkv.engine.llm import LLM, chat_prompts
from jaxkv.engine.outputs import RequestOutput
from jaxkv.model import checkpoint
from jaxkv.model.weights import load_config
from jaxkv.runner import sharding
from jaxkv.sample.sampler import SamplingParams


class DataParallelLLM:
    """``data_parallel_size`` LLM replicas, each over ``tensor_parallel_size`` devices.

    Args:
      model: as for ``LLM``.
      data_parallel_size: number of replicas M.
      tensor_parallel_size: devices per replica N.
      devices: devices to use, in order (default ``jax.devices()``); the first M x N are taken.
      **engine_kwargs: every other ``LLM`` argument, given to each replica
        (``kv_events_config``: replica r publishes as data-parallel rank r, on its tcp ports
        + r, as vLLM's ranks).

    Raises:
      ValueError: bad sizes (before any weight is loaded), or any replica's argument error.
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", *, data_parallel_size: int,
                 tensor_parallel_size: int = 1, devices=None, **engine_kwargs):
        if engine_kwargs.pop("mesh", None) is not None:
            raise ValueError("mesh: data-parallel replicas build their own mesh; pass devices")
        devices = list(jax.devices() if devices is None else devices)
        config = (checkpoint.read_config(model) if checkpoint.is_checkpoint(model)
                  else load_config(model))
        sharding.check_parallel_sizes(config, tensor_parallel_size, data_parallel_size,
                                      num_devices=len(devices))
        self.mesh = sharding.make_mesh(tensor_parallel_size, data_parallel_size, devices)
        self.replicas: list[LLM] = []
        events = KVEventsConfig.of(engine_kwargs.pop("kv_events_config", None))
        for rank, row in enumerate(self.mesh.devices):
            sub = jax.sharding.Mesh(row.reshape(1, -1), sharding.MESH_AXES)
            self.replicas.append(LLM(model, tensor_parallel_size=tensor_parallel_size, mesh=sub,
                                     kv_events_config=events and events.for_rank(rank),
                                     **engine_kwargs))
        self.tokenizer = self.replicas[0].tokenizer
        self.model_config = self.replicas[0].model_config

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 = None, *, use_tqdm: bool = False) -> list[RequestOutput]:
        """``LLM.generate`` spread over the replicas; outputs in input order.

        Request ids are those of the replica that ran the request.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for "
                             f"{len(prompts)} prompts")
        m = len(self.replicas)
        shares = [list(range(r, len(prompts), m)) for r in range(m)]

        def run(r: int) -> list[RequestOutput]:
            idx = shares[r]
            if not idx:
                return []
            return self.replicas[r].generate([prompts[i] for i in idx], [params[i] for i in idx],
                                             use_tqdm=use_tqdm and r == 0)

        with ThreadPoolExecutor(max_workers=m) as pool:
            per_replica = list(pool.map(run, range(m)))
        results: list[RequestOutput | None] = [None] * len(prompts)
        for idx, outs in zip(shares, per_replica):
            for i, out in zip(idx, outs):
                results[i] = out
        return results

    def chat(self, messages, sampling_params: SamplingParams | None = None, *,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """``LLM.chat`` spread over the replicas (one conversation or a list of them)."""
        return self.generate(chat_prompts(self.tokenizer, messages), sampling_params,
                             use_tqdm=use_tqdm)

    def warmup(self, shapes: Sequence[tuple[int, int]] | None = None) -> int:
        """``LLM.warmup`` on every replica; returns the step variants compiled per replica."""
        return [r.warmup(shapes) for r in self.replicas][0]

    @property
    def memory_plan(self):
        """The memory plan of one replica (all replicas are planned alike)."""
        return self.replicas[0].memory_plan

    @property
    def cache_config(self):
        return self.replicas[0].cache_config

    @property
    def sched_config(self):
        return self.replicas[0].sched_config

    def stats(self) -> dict:
        """Counters summed over replicas (usage fractions: the highest), plus each replica's
        ``LLM.stats()`` under ``"replicas"``."""
        per = [r.stats() for r in self.replicas]
        out = {k: sum(s[k] for s in per) for k in per[0]
               if k.startswith("num_") or k.startswith("kv_blocks") or k == "kv_tokens_live"}
        out |= {"kv_usage": max(s["kv_usage"] for s in per),
                "kv_usage_peak": max(s["kv_usage_peak"] for s in per),
                "data_parallel_size": len(per), "replicas": per}
        return out

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    def __enter__(self) -> "DataParallelLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
