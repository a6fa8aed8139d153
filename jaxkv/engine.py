"""LLM: the engine, the only stateful object of jaxkv (vLLM's ``LLM`` API shape).

    llm = LLM(model="SmolLM2-135M-Instruct")
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))

One engine step (``LLM.step``):

    scheduler.schedule(state) ─► StepPlan ─► batch.build ─► StepInput ─┐
                                                                       ▼
    scheduler.update(state, plan, tokens) ◄── tokens ◄── step(params, cache, inputs, sampling, rng)

The engine owns the immutable scheduler state (replaced, never mutated, so a failing call leaves
it as it was), the device params and the donated cache, and a ``jaxkv.requests.RequestTable``:
the per-request host bookkeeping (detokenized text, stop strings, logprobs and timestamps).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxkv import batch, beam_search, planner, scheduler, sharding
from jaxkv.beam_search import BeamSearchOutput, BeamSearchParams
from jaxkv.cache import KV_CACHE_QUANT_DTYPES, check_quant_geometry, copy_blocks, init_cache
from jaxkv.config import PREFIX_CACHING_MODES, CacheConfig, SchedulerConfig
from jaxkv.model import checkpoint
from jaxkv.model.llama import param_shapes, params_from_hf
from jaxkv.model.weights import load_config, load_model_files
from jaxkv.outputs import RequestOutput
from jaxkv.requests import MAX_LOGPROBS, Request, RequestTable
from jaxkv.sampling import SamplingParams, SamplingTensors
from jaxkv.step import DeviceStepInput, make_step, step_rng

logger = logging.getLogger("jaxkv")

DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOGPROB_BUCKETS = (0, 1, 5, MAX_LOGPROBS)   # static top-N sizes the step is compiled for


def _default_backend_choices(dtype: str, attention_impl: str | None) -> tuple[str, str]:
    on_gpu = jax.default_backend() == "gpu"
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    return dtype, attention_impl or ("pallas" if on_gpu else "reference")


class LLM:
    """An offline inference engine over a paged KV cache with continuous batching.

    Args:
      model: a store name (default ``"SmolLM2-135M-Instruct"``), a ``.gguf`` file or an HF
        model directory.
      dtype: ``"auto"`` (bfloat16 on GPU, float32 on CPU), ``"float32"``, ``"bfloat16"``,
        ``"float16"``: parameter, activation and KV dtype.
      kv_cache_dtype: ``"auto"`` (= ``dtype``), ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``,
        ``"fp8_e5m2"``, ``"int8"`` (per-token-per-head scales), ``"int4"``, ``"int2"`` (KIVI:
        keys per channel per block, values per token, the residual window in full precision);
        see jaxkv/cache.py and jaxkv/quant.py.
      kv_residual_blocks: int4/int2 only: KIVI's residual window R in blocks: the unsealed block
        plus the last R - 1 sealed blocks of every sequence stay in full precision (costs
        ``R * max_num_seqs + 1`` full-precision blocks, counted by the planner).
      kv_group_size: int4/int2 only: channels per bf16 scale and zero of a value vector (KIVI's
        group, default 32); with ``block_size`` (the key group) it sets the metadata overhead.
      block_size: tokens per KV block.
      max_model_len: longest prompt + output; default ``min(model context, 8192)``.
      max_num_seqs: most sequences per step.
      max_num_batched_tokens: token budget per step (decodes + prefill chunks).
      memory_utilization: fraction of device memory the engine plans with (on CPU: of
        ``planner.host_memory_budget()``, half of the available host memory).
      kv_cache_bytes: KV pool size in bytes, instead of the utilization sizing.
      num_kv_blocks: KV pool size in blocks (including the null block), instead of both.
      seed: engine seed for requests without their own.
      policy: ``"fcfs"`` or ``"priority"``.
      attention_impl: ``"reference"`` or ``"pallas"``; default pallas on GPU, reference on CPU.
      interpret: run Pallas kernels in interpret mode (CPU).
      warmup: compile every (tokens, sequences) bucket at start, so no step compiles later.
      token_buckets, seq_buckets: padded step shapes (default powers of two; see SchedulerConfig).
      prefix_caching: ``"hash"`` (default; full blocks by hash chain), ``"radix"`` (token
        granular, partial blocks by copy-on-write) or None; see jaxkv/prefix_cache.py.
      tensor_parallel_size: devices the model is split over (jaxkv.sharding: heads, kv heads,
        mlp and vocab over the mesh axis "tp"; kv heads repeated when fewer than devices).
      data_parallel_size: independent engine replicas, each over its own ``tensor_parallel_size``
        devices; ``> 1`` returns a ``jaxkv.replicas.DataParallelLLM`` (same generate API).
      mesh: an explicit engine mesh ``{"dp": 1, "tp": tensor_parallel_size}`` (default: the
        first ``tensor_parallel_size`` of ``jax.devices()``, every process's under multi-host).

    ``model`` may also be an orbax checkpoint written by ``jaxkv.model.checkpoint.convert``:
    each device then restores only its own shards.

    Raises:
      ValueError: naming the argument that is invalid, before any weight is loaded where possible
        (parallel sizes and mesh are always checked before).
    """

    def __new__(cls, *args, data_parallel_size: int = 1, **kwargs):
        if cls is LLM and isinstance(data_parallel_size, int) and data_parallel_size > 1:
            from jaxkv.replicas import DataParallelLLM   # replicas imports this module
            return DataParallelLLM(*args, data_parallel_size=data_parallel_size, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: str = "SmolLM2-135M-Instruct", *, dtype: str = "auto",
                 kv_cache_dtype: str = "auto", kv_residual_blocks: int = 1,
                 kv_group_size: int = planner.KIVI_GROUP_SIZE,
                 block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, memory_utilization: float = 0.9,
                 kv_cache_bytes: int | None = None, num_kv_blocks: int | None = None,
                 seed: int = 0, policy: str = "fcfs", attention_impl: str | None = None,
                 interpret: bool = False, warmup: bool = False,
                 prefix_caching: str | None = "hash",
                 token_buckets: Sequence[int] | None = None,
                 seq_buckets: Sequence[int] | None = None, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, mesh: jax.sharding.Mesh | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
        if attention_impl not in (None, "reference", "pallas"):
            raise ValueError(f"attention_impl={attention_impl!r} is not one of "
                             f"('reference', 'pallas')")
        if prefix_caching not in (None, *PREFIX_CACHING_MODES):
            raise ValueError(f"prefix_caching={prefix_caching!r} is not one of "
                             f"{PREFIX_CACHING_MODES} or None")
        dtype, attention_impl = _default_backend_choices(dtype, attention_impl)
        self.kv_cache_dtype = planner.resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        if not isinstance(kv_residual_blocks, int) or kv_residual_blocks < 1:
            raise ValueError(f"kv_residual_blocks={kv_residual_blocks!r} must be an int >= 1")
        self.kv_residual_blocks = kv_residual_blocks
        if not isinstance(kv_group_size, int) or kv_group_size < 1:
            raise ValueError(f"kv_group_size={kv_group_size!r} must be an int >= 1")
        self.kv_group_size = kv_group_size
        from_checkpoint = checkpoint.is_checkpoint(model)
        config = checkpoint.read_config(model) if from_checkpoint else load_config(model)
        sharding.check_parallel_sizes(config, tensor_parallel_size, data_parallel_size,
                                      num_devices=len(jax.devices()))
        if data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={data_parallel_size}: a single engine is one "
                             "replica; use LLM(...) or jaxkv.replicas.DataParallelLLM")
        if mesh is not None:
            sharding.check_mesh(mesh, tensor_parallel_size)
        elif tensor_parallel_size > 1:
            mesh = sharding.make_mesh(tensor_parallel_size)
        if self.kv_cache_dtype in KV_CACHE_QUANT_DTYPES:
            check_quant_geometry(self.kv_cache_dtype, block_size=block_size,
                                 head_dim=config.head_dim, group_size=kv_group_size)
            if mesh is not None:
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported with "
                                 f"tensor parallelism yet; use a float KV cache")
            if attention_impl == "pallas" and self.kv_cache_dtype in ("int4", "int2"):
                from jaxkv.pallas.kv_format import kivi_chunk_width

                kivi_chunk_width(self.kv_cache_dtype, config.head_dim,
                                 min(kv_group_size, config.head_dim))
        self.mesh = mesh
        self.tensor_parallel_size = tensor_parallel_size
        self.model_config = config
        max_model_len = max_model_len or min(config.max_position_embeddings, 8192)
        self.sched_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, policy=policy,
            token_buckets=tuple(token_buckets) if token_buckets else None,
            seq_buckets=tuple(seq_buckets) if seq_buckets else None)
        self.memory_plan = self._plan(dtype, block_size, memory_utilization, kv_cache_bytes,
                                      num_kv_blocks)
        logger.info("%s", self.memory_plan.summary())
        if not self.memory_plan.runs:
            raise ValueError("the model does not fit: " + "; ".join(self.memory_plan.reasons))
        kivi = self.kv_cache_dtype in ("int4", "int2")
        self.cache_config = CacheConfig(block_size=block_size,
                                        num_blocks=self.memory_plan.num_blocks,
                                        prefix_caching=prefix_caching,
                                        residual_window_blocks=kv_residual_blocks if kivi else 0)
        self.dtype = jnp.dtype(dtype)
        self.params, self.tokenizer = self._load(model, from_checkpoint)
        c = sharding.tp_config(config, tensor_parallel_size)   # kv heads as the devices hold them
        if mesh is None:
            self.cache = init_cache(c.num_layers, self.cache_config.num_blocks, block_size,
                                    c.num_kv_heads, c.head_dim, self.dtype,
                                    kv_cache_dtype=self.kv_cache_dtype,
                                    residual_blocks=kv_residual_blocks,
                                    group_size=kv_group_size,
                                    num_residual_slots=planner.kivi_residual_slots(
                                        max_num_seqs, kv_residual_blocks))
        else:
            self.cache = sharding.init_sharded_cache(c.num_layers, self.cache_config.num_blocks,
                                                     block_size, c.num_kv_heads, c.head_dim,
                                                     self.dtype, mesh)
        self.attention_impl = attention_impl
        self._step_fn = make_step(c, attention_impl=attention_impl, interpret=interpret,
                                  mesh=mesh)
        self._seed = seed
        self._state = scheduler.init_state(self.cache_config)
        self._table = RequestTable(self.tokenizer, config.vocab_size, max_model_len)
        self._num_steps = 0
        self._num_preemptions = 0
        self._peak_usage = 0.0
        self._num_generated = 0
        self._num_prompt_tokens = 0
        self._num_computed_tokens = 0   # tokens the device computed (no padding)
        self._num_lookup_tokens = 0     # prefix-cache queries, tokens
        self._num_hit_tokens = 0        # of which found cached (or shared by a fork)
        self._busy_time = 0.0      # seconds inside step()
        self._device_time = 0.0    # of which: the jitted step until its tokens reach the host
        self._closed = False
        if warmup:
            self.warmup()

    # ------------------------------------------------------------------ setup

    def _load(self, model, from_checkpoint: bool):
        """(params on this engine's devices, tokenizer) from model files or an orbax checkpoint."""
        c = self.model_config
        if from_checkpoint:
            if self.mesh is None:
                dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
                shardings = jax.tree.map(lambda _: dev, param_shapes(c, self.dtype))
            else:
                shardings = sharding.stored_param_shardings(c, self.mesh)
            params = checkpoint.restore_params(model, param_shapes(c, self.dtype), shardings)
            tokenizer = checkpoint.read_tokenizer(model)
            self.model_path = Path(model)
        else:
            loaded = load_model_files(model)
            self.model_path = Path(loaded.source)
            params = params_from_hf(c, loaded.tensors, self.dtype, source=loaded.source)
            tokenizer = loaded.tokenizer
        if self.mesh is not None:
            params = sharding.shard_params(params, c, self.mesh)
        return params, tokenizer

    def _to_device(self, tree):
        """Host step inputs as device arrays: replicated over the mesh under tensor parallelism."""
        return tree if self.mesh is None else sharding.put_replicated(tree, self.mesh)

    def _to_host(self, x) -> np.ndarray:
        return np.asarray(x) if self.mesh is None else sharding.to_host(x)

    def _plan(self, dtype, block_size, memory_utilization, kv_cache_bytes, num_kv_blocks):
        c, s = self.model_config, self.sched_config
        if jax.default_backend() == "cpu":
            device_memory = planner.host_memory_budget()
        else:
            device_memory = jax.local_devices()[0].memory_stats()["bytes_limit"]
        kw = dict(device_memory_bytes=device_memory, memory_utilization=memory_utilization,
                  dtype=dtype, kv_cache_dtype=self.kv_cache_dtype, block_size=block_size,
                  max_model_len=s.max_model_len,
                  max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                  kv_cache_bytes=kv_cache_bytes, num_kv_blocks=num_kv_blocks,
                  tensor_parallel_size=self.tensor_parallel_size,
                  kv_residual_blocks=self.kv_residual_blocks,
                  kv_group_size=self.kv_group_size)
        plan = planner.plan(c, **kw)
        # a pool larger than max_num_seqs full-length sequences is never used: don't allocate it
        cap = s.max_num_seqs * plan.blocks_per_seq + 1
        if num_kv_blocks is None and kv_cache_bytes is None and plan.num_blocks > cap:
            plan = planner.plan(c, **{**kw, "num_kv_blocks": cap})
        return plan

    def warmup(self) -> int:
        """Compiles the step for every (T, S) bucket pair with S <= T; returns how many.

        Steps that ask for top logprobs compile once more per logprobs bucket (1, 5, 20).
        Also compiles the copy-on-write block copy for every padded batch size (not counted).
        """
        n = 0
        for t in self.sched_config.token_buckets:
            for s in self.sched_config.seq_buckets:
                if s <= t:
                    self._run_padded(t, s)
                    n += 1
        copies = 1   # a step copies at most one block per sequence, padded to a power of two
        while copies < 2 * self.sched_config.max_num_seqs:
            null = jnp.zeros(copies, jnp.int32)
            self.cache = copy_blocks(self.cache, null, null)   # null block onto itself
            copies *= 2
        return n

    def _run_padded(self, t: int, s: int) -> None:
        """Runs one all-padding step of shape (t, s): writes only to the null block."""
        self.cache, tokens, *_ = self._step_fn(self.params, self.cache, *self._padded_args(t, s),
                                               num_logprobs=0)
        tokens.block_until_ready()

    def compiled_step_text(self, num_tokens: int, num_seqs: int) -> str:
        """The optimized HLO text of the step compiled for one (tokens, sequences) bucket.

        Under tensor parallelism it shows the collectives (2 all-reduces per layer, see
        jaxkv.sharding.count_all_reduces).
        """
        return self._step_fn.lower(self.params, self.cache, *self._padded_args(
            num_tokens, num_seqs), num_logprobs=0).compile().as_text()

    def _padded_args(self, t: int, s: int):
        """(inputs, sampling, rng) of an all-padding step of shape (t, s), on the devices."""
        m = batch.max_blocks_per_seq(self.cache_config, self.sched_config)
        inputs = DeviceStepInput(
            token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
            slot_mapping=np.zeros(t, np.int32), query_start_loc=np.zeros(s + 1, np.int32),
            seq_lens=np.zeros(s, np.int32), block_tables=np.zeros((s, m), np.int32),
            logits_indices=np.zeros(s, np.int32))
        sampling = SamplingTensors.from_params([], vocab_size=self.model_config.vocab_size,
                                               prompt_token_ids=[], output_token_ids=[], pad_to=s)
        return self._to_device((inputs, sampling, step_rng(self._seed, 0)))

    # ------------------------------------------------------------------ requests

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this LLM was closed")

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt (``RequestTable.tokenize``; beam search's)."""
        return self._table.tokenize(prompt)

    def _add(self, new: list[tuple[Request, list[scheduler.Request]]]) -> None:
        """Adds validated requests all together, or none of them (the state is immutable)."""
        state = self._state
        for _, reqs in new:
            for r in reqs:
                state = scheduler.add_request(state, r, self.sched_config)
        self._state = state
        self._table.add(new)

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0, cache_salt=None) -> str:
        """Queues one prompt (a str or ``{"prompt_token_ids": [...]}``); returns its request id.

        ``cache_salt`` (any hashable): the request shares cached prefix blocks only with requests
        of the same salt (tenant isolation).

        Raises:
          ValueError: naming what is wrong; nothing is queued then.
        """
        self._check_open()
        new = self._table.new_request(prompt, sampling_params or SamplingParams(),
                                      priority=priority, request_id=request_id,
                                      cache_salt=cache_salt)
        self._add([new])
        return new[0].request_id

    def abort_request(self, request_id: str) -> None:
        """Aborts a queued or running request; its blocks are freed at once."""
        req = self._table.requests.get(str(request_id))
        if req is None:
            raise ValueError(f"request_id={request_id!r} is not queued or running")
        state = self._state
        for i, s in enumerate(req.samples):
            if not s.completion.finished:
                state = scheduler.abort(state, f"{req.request_id}#{i}")
        self._state = state
        self._table.collect_finished(self._state.finished)

    def has_unfinished_requests(self) -> bool:
        return bool(self._state.requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the outputs of requests that got tokens or finished.

        Finished requests are returned once, with ``finished`` True, and then forgotten.
        """
        self._check_open()
        t0 = time.perf_counter()
        state, plan = scheduler.schedule(self._state, self.sched_config)
        self._num_preemptions += len(plan.preempted_ids)
        if not plan.seqs:
            self._state = state
            return self._table.collect_finished(self._state.finished)
        samples = self._table.samples
        tokens, logprobs, top_ids, top_vals = self._run_plan(
            state, plan, [samples[s.request_id].params for s in plan.seqs])
        now = time.perf_counter()
        touched: dict[str, Request] = {}
        stop_hits = set()
        for row, seq in enumerate(plan.seqs):
            sample = samples[seq.request_id]
            req = self._table.requests[sample.parent]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
                req.num_cached_tokens = seq.num_cached_tokens
            if seq.start_pos == 0:
                self._num_prompt_tokens += len(seq.token_ids)
            if not seq.sample:
                continue
            if sample.append(int(tokens[row]), float(logprobs[row]), top_ids[row], top_vals[row]):
                stop_hits.add(seq.request_id)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.num_generated_tokens += 1
            self._num_generated += 1
            touched[req.request_id] = req
        self._peak_usage = max(self._peak_usage, state.block_manager.usage())
        self._state = scheduler.update(state, plan, tokens, finished_ids=frozenset(stop_hits))
        self._busy_time += time.perf_counter() - t0
        finished = self._table.collect_finished(self._state.finished)
        done = {o.request_id for o in finished}
        return finished + [r.output() for rid, r in touched.items() if rid not in done]

    def _run_plan(self, state: scheduler.SchedulerState, plan: scheduler.StepPlan,
                  params: Sequence[SamplingParams]):
        """Runs ``plan`` (scheduled from ``state``) on device, one ``params`` per seq.

        Returns host arrays ``(tokens [S], logprobs [S], top_ids [S, N], top_vals [S, N])``,
        row ``i`` for ``plan.seqs[i]``; ``N`` is the logprobs bucket of ``max(p.logprobs)``.
        """
        self._apply_copies(plan)
        inputs = batch.build(plan, self.cache_config, self.sched_config)
        live = [state.requests[s.request_id] for s in plan.seqs]
        num_logprobs = next(b for b in _LOGPROB_BUCKETS if b >= max(
            (p.logprobs or 0) for p in params))
        sampling = SamplingTensors.from_params(
            list(params), vocab_size=self.model_config.vocab_size,
            prompt_token_ids=[rs.request.prompt_token_ids for rs in live],
            output_token_ids=[rs.output_token_ids for rs in live],
            eos_token_ids=self.tokenizer.eos_token_ids, pad_to=len(inputs.seq_lens))
        t_device = time.perf_counter()
        self.cache, tokens, logprobs, (top_ids, top_vals) = self._step_fn(
            self.params, self.cache, *self._to_device((
                DeviceStepInput.from_host(inputs), sampling,
                step_rng(self._seed, self._num_steps))), num_logprobs=num_logprobs)
        tokens, logprobs = self._to_host(tokens), self._to_host(logprobs)
        top_ids, top_vals = self._to_host(top_ids), self._to_host(top_vals)
        self._device_time += time.perf_counter() - t_device
        self._num_steps += 1
        return tokens, logprobs, top_ids, top_vals

    def _apply_copies(self, plan: scheduler.StepPlan) -> None:
        """Applies the plan's copy-on-write block copies on device and counts its cache hits."""
        self._num_lookup_tokens += plan.num_lookup_tokens
        self._num_hit_tokens += plan.num_hit_tokens
        self._num_computed_tokens += plan.num_tokens
        if plan.copy_ops:
            n = 1 << (len(plan.copy_ops) - 1).bit_length()   # pad to a power of two: few compiles
            ops = np.zeros((n, 2), np.int32)                 # padding copies null -> null
            ops[:len(plan.copy_ops)] = plan.copy_ops
            self.cache = copy_blocks(self.cache, jnp.asarray(ops[:, 0]), jnp.asarray(ops[:, 1]))

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search over one prompt or a list of them (see jaxkv/beam_search.py); the beams
        share their blocks and copy only a diverging last block. Needs an idle engine."""
        self._check_open()
        return beam_search.run(self, prompts, params)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (running requests keep their blocks)."""
        bm = self._state.block_manager.copy()
        bm.reset_prefix_cache()
        self._state = dataclasses.replace(self._state, block_manager=bm)

    # ------------------------------------------------------------------ high level

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 cache_salt=None
                 ) -> list[RequestOutput]:
        """Generates completions for a batch of prompts with continuous batching.

        Args:
          prompts: a str, a ``{"prompt_token_ids": [...]}`` dict, or a list of them.
          sampling_params: one ``SamplingParams`` for all, or one per prompt (default greedy-free
            vLLM defaults: temperature 1, max_tokens 16).
          use_tqdm: show a progress bar of finished requests.
          priority: per-prompt priorities (policy ``"priority"``; lower is more urgent).
          cache_salt: prefix-cache namespace of these prompts (any hashable): they share cached
            blocks only with requests of the same salt.

        Returns:
          One ``RequestOutput`` per prompt, in input order.

        Raises:
          ValueError: naming the bad prompt or parameter; nothing is queued then and requests
            already in the engine keep running.
        """
        self._check_open()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        prio = list(priority) if priority is not None else [0] * len(prompts)
        if len(prio) != len(prompts):
            raise ValueError(f"priority has {len(prio)} entries for {len(prompts)} prompts")
        new = []
        for i, (p, sp, pr) in enumerate(zip(prompts, params, prio)):
            try:
                new.append(self._table.new_request(p, sp, priority=pr, cache_salt=cache_salt))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        try:
            self._add(new)
        except ValueError as e:
            raise ValueError(f"generate: {e}") from None
        order = {req.request_id: i for i, (req, _) in enumerate(new)}
        results: list[RequestOutput | None] = [None] * len(new)
        with tqdm(total=len(new), disable=not use_tqdm, desc="Generating", unit="req") as bar:
            while any(r is None for r in results):
                for out in self.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        return results

    def stream(self, prompt, sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Generates one prompt, yielding its ``RequestOutput`` after every step that adds tokens.

        Other queued requests advance in the same steps. Closing the iterator aborts the request.
        """
        rid = self.add_request(prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished and rid in self._table.requests:
                self.abort_request(rid)

    def chat(self, messages, sampling_params: SamplingParams | None = None, *,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of ``{"role", "content"}``) or a list of them,
        rendered with the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)}
                   for t in (self.tokenizer.apply_chat_template(c) for c in convs)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        """KV usage and throughput counters since start.

        Returns:
          dict with ``kv_blocks_total`` (usable, excluding the null block), ``kv_blocks_used``,
          ``kv_blocks_free``, ``kv_usage`` (fraction), ``kv_usage_peak`` (highest fraction in any
          step), ``kv_tokens_live`` (tokens whose K/V is cached for live requests), ``num_running``, ``num_waiting``,
          ``num_preemptions``, ``num_steps``, ``num_prompt_tokens``, ``num_generated_tokens``,
          ``generation_tokens_per_s`` (generated tokens / time spent in steps),
          ``num_computed_tokens`` (tokens the device computed), ``prefix_cache_queries`` and
          ``prefix_cache_hits`` (tokens of admitted requests, and of those the tokens found in
          the prefix cache or shared by a fork), ``prefix_cache_hit_rate`` (their ratio),
          ``num_cached_blocks`` (blocks in the prefix cache, in use or free),
          ``host_time_fraction`` (share of step time spent on the host: scheduling, batch
          building, sampling tensors, detokenization; the rest is the jitted step).
        """
        bm = self._state.block_manager
        total = self.cache_config.num_usable_blocks
        return {
            "kv_blocks_total": total,
            "kv_blocks_used": total - bm.num_free_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_usage": bm.usage(),
            "kv_usage_peak": self._peak_usage,
            "kv_tokens_live": sum(rs.num_computed_tokens for rs in self._state.requests.values()),
            "num_running": len(self._state.running),
            "num_waiting": len(self._state.waiting),
            "num_preemptions": self._num_preemptions,
            "num_steps": self._num_steps,
            "num_prompt_tokens": self._num_prompt_tokens,
            "num_generated_tokens": self._num_generated,
            "num_computed_tokens": self._num_computed_tokens,
            "prefix_cache_queries": self._num_lookup_tokens,
            "prefix_cache_hits": self._num_hit_tokens,
            "prefix_cache_hit_rate": self._num_hit_tokens / self._num_lookup_tokens
            if self._num_lookup_tokens else 0.0,
            "num_cached_blocks": bm.num_cached_blocks,
            "generation_tokens_per_s": self._num_generated / self._busy_time
            if self._busy_time else 0.0,
            "host_time_fraction": 1.0 - self._device_time / self._busy_time
            if self._busy_time else 0.0,
        }

    def num_compilations(self) -> int:
        """How many step variants have been compiled (a steady state adds none)."""
        return self._step_fn._cache_size()

    def close(self) -> None:
        """Frees device memory (params and cache); the engine cannot be used afterwards."""
        for leaf in jax.tree_util.tree_leaves((self.params, self.cache)):
            leaf.delete()
        self.params = self.cache = None
        self._closed = True

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        if not self._closed:
            self.close()
