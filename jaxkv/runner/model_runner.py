"""ModelRunner: the device side of the engine: params, the donated paged KV cache, the jitted step.

    ModelRunner(config)           resolve dtype / attention, plan the pool, load the weights,
                                  allocate the cache, build the jitted step
    runner.execute(plan, rows)    host-tier transfers and copy-on-write block copies, then one step:
                                  StepPlan ─► batch.build ─► step(params, cache, ...) ─► host arrays
                                  (a sequence with draft tokens gets 1 + k sampled rows and
                                  its accepted count: jaxkv/sample/rejection.py)

The runner knows nothing about requests: ``execute`` takes the plan and, per scheduled sequence,
its sampling parameters and token history, and returns host arrays row by row. ``EngineCore``
(jaxkv/engine/core.py) owns the requests and the scheduler state.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxkv.config import CacheConfig, EngineConfig
from jaxkv.config.resolve import quest_options, resolve
from jaxkv.kvcache.pages import copy_blocks, init_cache
from jaxkv.kvcache.spec import KVCacheSpec, kivi_residual_slots
from jaxkv.model import checkpoint, quantize
from jaxkv.model.llama import param_shapes, params_from_hf
from jaxkv.model.quantization import scale_group
from jaxkv.model.weights import (is_mxfp4, kept_k_group, load_config, load_model_files,
                                 stored_weights_bytes)
from jaxkv.retention import from_args
from jaxkv.runner import batch, device_shares, memory_plan, sharding
from jaxkv.runner.kv_offload import KVOffload
from jaxkv.runner.step import DeviceStepInput, make_step, step_rng
from jaxkv.sample.sampler import MAX_LOGPROBS, SamplingParams, SamplingTensors
from jaxkv.sched.plan import StepPlan

logger = logging.getLogger("jaxkv")

_LOGPROB_BUCKETS = (0, 1, 5, MAX_LOGPROBS)   # static top-N sizes the step is compiled for


@dataclasses.dataclass(frozen=True)
class RowInput:
    """What the runner needs of one scheduled sequence besides the plan.

    Attributes:
      params: its sampling parameters.
      prompt_token_ids: its prompt (penalties read it).
      output_token_ids: its generated tokens so far (penalties and seeded rngs read them).
      grammar_bitmasks: int32 [1 + drafts, ceil(V / 32)] the tokens its structured output
        allows at each position it samples (``structured.Matcher.bitmasks``), or None.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    grammar_bitmasks: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Host arrays of one step; row ``i`` belongs to ``plan.seqs[i]`` (padding rows follow), and
    sequence ``i`` emits ``tokens[i, :num_accepted[i]]`` (one token without drafts).

    Attributes:
      tokens: int32 [S, W], the sampled tokens: ``[i, j]`` after the sequence's ``j``-th draft
        (``W = 1`` in a step without drafts).
      num_accepted: int32 [S], how many of them the sequence emits (1 + its accepted drafts).
      logprobs: float32 [S, W], their raw log-probabilities.
      top_ids: int32 [S, W, N], the top-N token ids (N the logprobs bucket of the step, maybe 0).
      top_vals: float32 [S, W, N], their log-probabilities.
      block_mass: float32 [S, max_blocks], the attention mass each KV block got this step
        (a retention policy's scores, ``Retention.observe``), or None.
    """

    tokens: np.ndarray
    num_accepted: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_vals: np.ndarray
    block_mass: np.ndarray | None = None


def plan_memory(config: EngineConfig, model_config,
                device_memory_bytes: int | None = None) -> memory_plan.MemoryPlan:
    """The memory plan of an engine config for a model on this backend, with ``kv_source``
    saying what sized the pool.

    Unless the pool size is given (``num_gpu_blocks_override``, ``kv_cache_memory_bytes``), it
    is what the budget leaves (``gpu_memory_utilization`` x the device memory, less weights and
    activations), capped at what ``max_num_seqs`` full-length sequences can use: ``min(budget,
    max_num_seqs x max_model_len)``; under a retention policy a sequence counts the blocks it
    holds at most (StreamingLLM: sinks + window + one step), and ``max_model_len`` may exceed
    the model's context. On the CPU (no ``device_memory_bytes`` given) also at
    ``memory_plan.CPU_KV_CACHE_BYTES``, or one full-length sequence where that is more.

    Args:
      device_memory_bytes: one device's memory (default: the first local device's limit; on
        CPU ``memory_plan.host_memory_budget()``).
    """
    r, cc, s = resolve(config, model_config), config.cache, config.scheduler
    retention = from_args(config.retention, model_config.sliding_window)
    retained = None if retention.name == "full" else retention.max_blocks(
        r.max_model_len, s.max_num_batched_tokens, cc.block_size)
    on_host = device_memory_bytes is None and jax.default_backend() == "cpu"
    if device_memory_bytes is None:
        device_memory_bytes = (memory_plan.host_memory_budget() if on_host
                               else jax.local_devices()[0].memory_stats()["bytes_limit"])
    kw = dict(device_memory_bytes=device_memory_bytes,
              memory_utilization=cc.gpu_memory_utilization,
              dtype=r.dtype, kv_cache_dtype=r.kv_cache_dtype, block_size=cc.block_size,
              max_model_len=r.max_model_len, max_num_seqs=s.max_num_seqs,
              max_num_batched_tokens=s.max_num_batched_tokens,
              kv_cache_bytes=cc.kv_cache_memory_bytes, num_kv_blocks=cc.num_gpu_blocks_override,
              tensor_parallel_size=config.parallel.tensor_parallel_size,
              kv_residual_blocks=cc.kv_residual_blocks, kv_group_size=r.kv_group_size,
              retained_blocks_per_seq=retained, hybrid_kv_cache=cc.hybrid_kv_cache,
              key_bounds=config.sparse.sparse_attention is not None,
              **_stored_weights(config, model_config, r.dtype))
    plan = memory_plan.plan(model_config, **kw)
    for field in ("num_gpu_blocks_override", "kv_cache_memory_bytes"):
        if getattr(cc, field) is not None:
            return dataclasses.replace(plan, kv_source=f"given {field}={getattr(cc, field)}")
    caps = [(s.max_num_seqs * plan.blocks_per_seq + 1,
             f"capped at max_num_seqs={s.max_num_seqs} sequences of {plan.max_model_len:,} "
             f"tokens")]
    if on_host:
        cpu = memory_plan.CPU_KV_CACHE_BYTES
        caps.append((max(cpu // plan.kv_bytes_per_block, plan.blocks_per_seq + 1),
                     f"the CPU default {memory_plan.format_bytes(cpu)}; --kv-cache-memory sets it"))
    cap, source = min(caps)
    if plan.num_blocks <= cap:
        where = " (half the available host memory)" if on_host else ""
        return dataclasses.replace(plan, kv_source=(
            f"{cc.gpu_memory_utilization:g} x {memory_plan.format_bytes(device_memory_bytes)}"
            f"{where} less weights and activations"))
    capped = memory_plan.plan(model_config, **{**kw, "kv_cache_bytes": cap * plan.kv_bytes_per_block})
    return dataclasses.replace(capped, kv_source=source)


def keeps_quantized(config: EngineConfig, model_config=None) -> bool:
    """Whether the engine keeps a GGUF's quantized weights in their blocks (or a
    compressed-tensors checkpoint's in its codes, an MXFP4 checkpoint's experts in theirs):
    ``quantization`` None (as stored), on one device or under tensor parallelism where each
    device's share of o_proj's, down_proj's and an expert's down's K is whole groups
    (``weights.kept_k_group``, ``sharding.check_quantized_split``; elsewhere they are
    dequantized as with ``quantization='none'``). ``model_config``: the model's, else read
    from ``config.model.model``."""
    mc, tp = config.model, config.parallel.tensor_parallel_size
    if mc.quantization is not None:
        return False
    if tp == 1:
        return True
    model_config = model_config or load_config(mc.model)
    group, only_experts = kept_k_group(mc.model, model_config), is_mxfp4(mc.model)
    try:
        sharding.check_quantized_split(model_config, group, tp, only_experts=only_experts)
        if model_config.num_experts:      # a GGUF's kept experts (gpt-oss's MXFP4 among them)
            sharding.check_quantized_split(model_config, group, tp, only_experts=True)
    except ValueError:
        return False
    return True


def check_quantization(config: EngineConfig, from_checkpoint: bool, model_config=None) -> None:
    """Raises ValueError naming ``quantization`` where weights cannot be quantized at load:
    from an orbax checkpoint, a ``quantization`` other than None or what the checkpoint holds
    (``checkpoint.check_quantization``); under tensor parallelism, naming
    ``quantization_group_size`` where a device's share of o_proj's or down_proj's K would cut
    a group (``sharding.check_quantized_split``). ``model_config``: the model's, else read
    from ``config.model.model``."""
    mc, tp = config.model, config.parallel.tensor_parallel_size
    method = mc.quantization
    if from_checkpoint:
        checkpoint.check_quantization(mc.model, method, mc.quantization_group_size)
        return
    if method not in quantize.METHODS:
        return
    if tp > 1:
        group = scale_group(method, mc.quantization_group_size)            # None: per row
        try:
            sharding.check_quantized_split(model_config or load_config(mc.model), group, tp)
        except ValueError as e:
            raise ValueError(f"quantization={method!r}: {e}") from None


def _stored_weights(config: EngineConfig, model_config, dtype: str) -> dict:
    """``memory_plan.plan``'s ``stored_weights_bytes`` (one device's) and ``weights_format``
    where weights are quantized at load or by ``jaxkv convert`` (under tensor parallelism each
    tensor's shard, ``device_shares.device_tensor_shapes``) or stay in a GGUF's blocks
    (``keeps_quantized``, or an orbax checkpoint of them: under tensor parallelism the norms
    whole and the rest of the stored bytes times one device's share of the float weights, an
    estimate), else nothing."""
    mc, tp = config.model, config.parallel.tensor_parallel_size
    method, group = mc.quantization, mc.quantization_group_size
    from_checkpoint = checkpoint.is_checkpoint(mc.model)
    if from_checkpoint:
        held, held_group, _ = checkpoint.read_quantization(mc.model)
        method, group = (held, held_group) if held in quantize.METHODS else (None, group)
    dtype_bytes = memory_plan.WEIGHT_DTYPES[dtype]
    if method in quantize.METHODS:
        shapes = device_shares.device_tensor_shapes(model_config, tp)
        total = quantize.stored_bytes(shapes, method, group, dtype_bytes)
        return dict(stored_weights_bytes=total,
                    weights_format=f"{quantize.describe(method, group, model_config)}, "
                                   f"else {dtype}")
    if from_checkpoint:
        stored = checkpoint.stored_bytes(mc.model, dtype_bytes)
    elif keeps_quantized(config, model_config):
        stored = stored_weights_bytes(mc.model, model_config, dtype_bytes)
    else:
        return {}
    if stored is None:
        return {}
    # norms replicated, the rest split as one device's part of the float weights
    norms = (2 * model_config.num_layers + 1) * model_config.hidden_size * dtype_bytes
    share = ((memory_plan.weights_bytes(model_config, dtype, tp) - norms)
             / (memory_plan.weights_bytes(model_config, dtype) - norms))
    return dict(stored_weights_bytes=norms + round((stored[0] - norms) * share),
                weights_format=f"{stored[1]}, else {dtype}")


def _check_windows_hold_residual(groups, cc, kivi: bool) -> None:
    """A KIVI pool keeps each table's last ``kv_residual_blocks`` blocks in full precision:
    they must lie in every sliding group's window, so a block a window gives back never owns
    a residual slot (as ``StreamingRetention.check_block_size``)."""
    windows = [w for w in groups.windows if w is not None] if groups.hybrid else []
    if kivi and windows and min(windows) < cc.kv_residual_blocks * cc.block_size:
        raise ValueError(f"kv_residual_blocks={cc.kv_residual_blocks}: the KIVI residual window "
                         f"({cc.kv_residual_blocks * cc.block_size} tokens) must fit in the "
                         f"model's sliding_window={min(windows)}")


def verify_rows(plan: StepPlan, rows: Sequence[RowInput], width: int) -> list[RowInput]:
    """The sampler's rows of a step of logits width ``width``: row ``s * width + j`` is
    ``plan.seqs[s]``'s after its first ``j`` draft tokens, which count as generated tokens there
    (penalties, ``min_tokens`` and a seeded row's key see them); rows past a sequence's drafts
    repeat its last one (their samples are never emitted)."""
    out = []
    for seq, row in zip(plan.seqs, rows):
        drafts = tuple(seq.token_ids[len(seq.token_ids) - seq.num_drafts:])
        masks = row.grammar_bitmasks
        out += [dataclasses.replace(
            row, output_token_ids=(*row.output_token_ids, *drafts[:j]),
            grammar_bitmasks=None if masks is None else masks[min(j, len(masks) - 1):][:1])
            for j in range(width)]
    return out


class ModelRunner:
    """The model on its devices and the one jitted step over the paged KV cache.

    Args:
      config: the engine config (model, cache, scheduler, parallel and runtime groups).

    Attributes:
      model_config: the model's hyper-parameters.
      sched_config: ``config.scheduler`` with ``max_model_len`` resolved.
      cache_config: the pool as planned (block count included).
      memory_plan: the planner's sizing (``memory_plan.MemoryPlan``).
      kv_cache_dtype: the canonical KV format name.
      dtype: the parameter / activation dtype.
      attention_impl: one of ``ATTENTION_IMPLS`` (``"grouped"`` on CPU, ``"pallas"`` on GPU by
      default). max_drafts: most draft tokens a sequence carries (``num_speculative_tokens``; 0:
      off). retention: the KV retention policy (jaxkv/retention/): its attention options are
        compiled into the step, and the scheduler drops the blocks it no longer needs.
      sparse: Quest's static options (``quest_options``), or None (dense decode attention).
      mesh: the tensor-parallel mesh, or None on one device.
      params, cache, tokenizer, model_path: the loaded model and its KV cache.
      offload: the host KV tier and the persistent cache behind it (jaxkv/runner/kv_offload.py),
        once the engine attaches one (``attach_offload``), else None.

    Raises:
      ValueError: naming the argument that cannot work (checked before weights load where
        possible: parallel sizes, mesh, KV geometry, memory).
    """

    def __init__(self, config: EngineConfig):
        mc, cc, rc, pc = config.model, config.cache, config.runtime, config.parallel
        from_checkpoint = checkpoint.is_checkpoint(mc.model)
        model_config = (checkpoint.read_config(mc.model) if from_checkpoint
                        else load_config(mc.model))
        check_quantization(config, from_checkpoint, model_config)
        self.model_config = model_config
        r = resolve(config, model_config)
        self.attention_impl, self.kv_cache_dtype = r.attention_impl, r.kv_cache_dtype
        # decode-only steps take the split-K kernel (a step variant of their own) on Pallas
        self.split_k_decode = self.attention_impl == "pallas"
        tp = pc.tensor_parallel_size
        if pc.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={pc.data_parallel_size}: one engine is one "
                             "replica; use jaxkv.DataParallelLLM for data parallelism")
        sharding.check_parallel_sizes(model_config, tp, 1, num_devices=len(jax.devices()))
        mesh = pc.mesh
        if mesh is not None:
            sharding.check_mesh(mesh, tp)
        elif tp > 1:
            mesh = sharding.make_mesh(tp)
        self.mesh = mesh
        self.tensor_parallel_size = tp
        self.kv_group_size = r.kv_group_size
        self.kv_residual_blocks = cc.kv_residual_blocks
        self.sched_config = dataclasses.replace(config.scheduler, max_model_len=r.max_model_len)
        c = sharding.tp_config(model_config, tp)   # kv heads as the devices hold them
        # a hybrid cache's pages: one per layer of a group (jaxkv/config/kv_groups.py)
        groups = memory_plan.kv_groups(model_config, cc.hybrid_kv_cache)
        spec = KVCacheSpec(num_layers=groups.num_slots(c.num_layers), num_blocks=2,
                           block_size=cc.block_size,
                           num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=r.dtype,
                           kv_cache_dtype=r.kv_cache_dtype, group_size=r.kv_group_size,
                           residual_blocks=cc.kv_residual_blocks,
                           num_residual_slots=kivi_residual_slots(
                               self.sched_config.max_num_seqs, cc.kv_residual_blocks,
                               groups.num_groups),
                           key_bounds=config.sparse.sparse_attention is not None, layout=r.kv_layout,
                           v_head_dim=c.kv_cache_v_dim)     # 0: a latent (MLA) cache
        self.memory_plan = plan_memory(config, model_config)
        logger.info("%s", self.memory_plan.headline())
        if not self.memory_plan.runs:
            raise ValueError("the model does not fit: " + "; ".join(self.memory_plan.reasons))
        self.kv_spec = dataclasses.replace(spec, num_blocks=self.memory_plan.num_blocks)
        self._check_kv_support(self.kv_spec)
        self.retention = from_args(config.retention, model_config.sliding_window)
        self.retention.check_block_size(cc.block_size,
                                        cc.kv_residual_blocks if spec.format.kivi else 0)
        _check_windows_hold_residual(groups, cc, spec.format.kivi)
        if self.retention.observe and config.speculative.speculative:
            raise ValueError(f"kv_retention={config.retention.kv_retention!r} scores blocks by the sampling "
                             f"queries, which draft tokens would blur; speculative="
                             f"{config.speculative.speculative!r} is not supported with it")
        self.cache_config = CacheConfig(
            block_size=cc.block_size, num_blocks=self.memory_plan.num_blocks,
            prefix_caching=cc.prefix_caching,
            residual_window_blocks=cc.kv_residual_blocks if spec.format.kivi else 0,
            retention=self.retention, kv_groups=groups)
        self.sparse = quest_options(config, model_config,
                                    batch.max_blocks_per_seq(self.cache_config, self.sched_config),
                                    spec.format.kivi)
        self.dtype = jnp.dtype(r.dtype)
        self.params, self.tokenizer = self._load(mc, from_checkpoint,
                                                 keeps_quantized(config, model_config))
        self.cache = init_cache(self.kv_spec, None if mesh is None
                                else sharding.cache_shardings(self.kv_spec, mesh))
        self._seed = mc.seed
        self.max_drafts = config.speculative.max_drafts
        options = self.retention.attention
        step = functools.partial(make_step, sharding.tp_config(model_config, tp),
                                 attention_impl=self.attention_impl, interpret=rc.interpret,
                                 mesh=mesh, sparse=self.sparse,
                                 kv_groups=groups if groups.hybrid else None)
        self._step_fn = step(attention_options=options)
        # a plan that wants no scores (StepPlan.observe) runs without the block mass
        self._blind_step_fn = (step(attention_options=dataclasses.replace(options, observe=0))
                               if options.observe else self._step_fn)
        self.num_steps = 0
        self.device_time = 0.0   # seconds from a step's dispatch until its tokens are on the host
        self._variants_run: set[tuple] = set()   # (step fn, T, S, width, logprobs, decode)
        self.offload: KVOffload | None = None   # the host tier, if the engine attaches one

    # ------------------------------------------------------------------ setup

    def _check_kv_support(self, spec: KVCacheSpec) -> None:
        """Raises ValueError if the attention implementation cannot read ``spec``'s pools
        (checked with the planned block count, before the weights load). A latent pool (MLA)
        is read as its two chunks, ``c_kv`` and ``k_rope`` (``mla_decode.latent_layout``)."""
        if self.attention_impl == "pallas":
            from jaxkv.attention.pallas.kv_format import check_pallas_support
            from jaxkv.attention.pallas.mla_decode import latent_layout

            mla = self.model_config.mla
            if mla:
                latent_layout(mla.kv_lora_rank, mla.qk_rope_head_dim)
            check_pallas_support(spec, whole_heads=not mla)

    def _load(self, mc, from_checkpoint: bool, keep_quantized: bool):
        """(params on this engine's devices, tokenizer) from model files or an orbax checkpoint
        (its quantized weights restored as saved, each device reading its shards);
        ``keep_quantized``: a GGUF's dense Q8_0 / Q4_0 / Q4_1 weights stay in their blocks
        (Q4_K / Q6_K repacked, ``quantized.from_gguf``);
        ``mc.quantization`` one of ``quantize.METHODS``: the dense projections and experts
        quantized."""
        c, model = self.model_config, mc.model
        if from_checkpoint:
            target = checkpoint.restore_target(model, param_shapes(c, self.dtype))
            if self.mesh is None:
                dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
                shardings = jax.tree.map(lambda _: dev, target)
            else:
                shardings = sharding.stored_param_shardings(c, self.mesh, target)
            params = checkpoint.restore_params(model, target, shardings)
            tokenizer = checkpoint.read_tokenizer(model)
            self.model_path = Path(model)
        else:
            loaded = load_model_files(model, keep_quantized=keep_quantized)
            self.model_path = Path(loaded.source)
            tensors = loaded.tensors
            if mc.quantization in quantize.METHODS:
                tensors = quantize.quantize_tensors(tensors, mc.quantization,
                                                    mc.quantization_group_size, loaded.source)
            params = params_from_hf(c, tensors, self.dtype, source=loaded.source)
            tokenizer = loaded.tokenizer
        if self.mesh is not None:
            params = sharding.shard_params(params, c, self.mesh)
        return params, tokenizer

    def _to_device(self, tree):
        """Host step inputs as device arrays: replicated over the mesh under tensor parallelism."""
        return tree if self.mesh is None else sharding.put_replicated(tree, self.mesh)

    def _to_host(self, x) -> np.ndarray:
        return np.asarray(x) if self.mesh is None else sharding.to_host(x)

    # ------------------------------------------------------------------ compilation

    def warmup(self, shapes: Iterable[tuple[int, int]] | None = None, *,
               progress: bool = True) -> int:
        """Compiles the step for every (T, S) bucket pair a step can pad to and every
        decode-only step's shape (``SchedulerConfig.step_shapes``), or for the padded
        ``shapes`` only (those a known workload steps through: ``jaxkv.sched.dry_run``); returns how
        many step variants.

        Steps that ask for top logprobs compile once more per logprobs bucket (1, 5, 20), and
        with speculative decoding each pair is compiled at the verify width too; with a
        retention policy that scores blocks, each pair with and without the block mass. On
        the Pallas path, decode-only steps (``SchedulerConfig.decode_shapes``) compile a
        variant of their own, which runs the split-K decode kernel.
        Also compiles the copy-on-write block copy for every padded batch size and the host
        tier's transfers (not counted).
        With the persistent compilation cache on, a later start loads these from disk.

        Each variant is traced here and compiled on one of two threads (tracing holds the GIL,
        ~0.1-0.2 s a variant, its layers traced once; XLA's compile releases it, ~2.5 s), then
        run once on padding, which finds the executable in JAX's in-memory caches and puts it
        in the jitted step's own.
        """
        s = self.sched_config
        buckets, decode = s.step_shapes() if shapes is None else (sorted(shapes), [])
        widths = sorted({1, 1 + self.max_drafts})
        variants = [(t, n, w, False) for t, n in buckets for w in widths]   # (T, S, W, decode)
        if self.split_k_decode:        # every decode shape, as a decode-only variant
            decode = [x for x in s.decode_shapes() if shapes is None or x in buckets]
        variants += [(t, n, 1, self.split_k_decode) for t, n in decode]   # no drafts
        copies = [1 << i for i in range((2 * s.max_num_seqs - 1).bit_length())]
        fns = self._step_fns()
        logger.info("compiling %d step variants (%s)", len(variants) * len(fns),
                    ", ".join(f"{t}x{n}" for t, n, *_ in variants))
        t0 = time.perf_counter()
        with tqdm(total=len(variants) * len(fns) + len(copies), desc="Compiling step buckets",
                  unit="shape", disable=not progress) as bar, ThreadPoolExecutor(2) as compiler:
            jobs = []                       # (variant, args, its compile), in order
            for i, (t, n, w, d) in enumerate(variants):
                bar.set_postfix(traced=f"{i}/{len(variants)}", tokens=t, seqs=n, width=w)
                args = self._padded_args(t, n, w)
                for fn in fns:
                    job = compiler.submit(fn.lower(self.params, self.cache, *args,
                                                   num_logprobs=0, decode_only=d).compile)
                    job.add_done_callback(lambda _: bar.update(1))
                    jobs.append(((fn, t, n, w, 0, d), args, job))
            bar.set_postfix(traced=f"{len(variants)}/{len(variants)}")
            for variant, args, job in jobs:
                job.result()
                self.cache, tokens, *_ = variant[0](self.params, self.cache, *args,
                                                    num_logprobs=0, decode_only=variant[-1])
                tokens.block_until_ready()
                self._variants_run.add(variant)
            for n in copies:   # a step copies at most one block per sequence, padded to 2^k
                null = jnp.zeros(n, jnp.int32)
                self.cache = copy_blocks(self.cache, null, null)   # null block onto itself
                bar.update(1)
        if self.offload is not None:   # the host tier's batched transfers
            self.cache = self.offload.pool.warmup(self.cache)
        logger.info("compiled %d step variants in %.1f s", len(jobs), time.perf_counter() - t0)
        return len(jobs)

    def compiled_step_text(self, num_tokens: int, num_seqs: int) -> str:
        """The optimized HLO text of the step compiled for one (tokens, sequences) bucket.

        Under tensor parallelism it shows the collectives (2 all-reduces per layer, see
        jaxkv.runner.sharding.count_all_reduces).
        """
        return self._step_fn.lower(self.params, self.cache, *self._padded_args(
            num_tokens, num_seqs), num_logprobs=0).compile().as_text()

    def _step_fns(self) -> tuple:
        """The jitted step, and the one without the block mass when they differ."""
        return tuple(dict.fromkeys((self._step_fn, self._blind_step_fn)))

    def num_compilations(self) -> int:
        """How many step variants have been compiled (a steady state adds none)."""
        return sum(fn._cache_size() for fn in self._step_fns())

    def _padded_args(self, t: int, s: int, w: int = 1):
        """(inputs, sampling, rng) of an all-padding step of shape (t, s) and logits width w,
        on the devices: every slot is the null block's, so it writes nothing that is read."""
        m = batch.max_blocks_per_seq(self.cache_config, self.sched_config)
        g = self.cache_config.kv_groups.num_groups - 1
        inputs = DeviceStepInput(
            group_slot_mapping=np.zeros((g, t), np.int32),
            group_block_tables=np.zeros((g, s, m), np.int32),
            token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
            slot_mapping=np.zeros(t, np.int32), query_start_loc=np.zeros(s + 1, np.int32),
            seq_lens=np.zeros(s, np.int32), block_tables=np.zeros((s, m), np.int32),
            logits_indices=np.zeros((s, w), np.int32), num_drafts=np.zeros(s, np.int32),
            sample_mask=np.zeros(s, bool))
        sampling = SamplingTensors.from_params([], vocab_size=self.model_config.num_logits,
                                               prompt_token_ids=[], output_token_ids=[],
                                               pad_to=s * w)
        return self._to_device((inputs, sampling, step_rng(self._seed, 0)))

    # ------------------------------------------------------------------ the step

    def sampling_tensors(self, rows: Sequence[RowInput], pad_to: int) -> SamplingTensors:
        """The padded host sampling arrays of ``rows`` (raises ValueError on a row's bad value).

        A step with a penalty sends the token history at one fixed width, ``max_model_len``
        rounded up to a power of two, so a sequence growing past a length bucket never
        recompiles the step (the price: ``S x width`` int32 per penalised step)."""
        return SamplingTensors.from_params(
            [r.params for r in rows], vocab_size=self.model_config.num_logits,
            prompt_token_ids=[r.prompt_token_ids for r in rows],
            output_token_ids=[r.output_token_ids for r in rows],
            eos_token_ids=(self.tokenizer.eos_token_ids   # a draft's reduced head: columns,
                           if self.model_config.draft_vocab_size is None else ()),   # not ids
            pad_to=pad_to,
            history_pad_to=1 << max(4, (self.sched_config.max_model_len - 1).bit_length()),
            grammar_bitmasks=[None if r.grammar_bitmasks is None else r.grammar_bitmasks[0]
                              for r in rows])

    def execute(self, plan: StepPlan, rows: Sequence[RowInput]) -> StepOutput:
        """Runs ``plan`` on the device: its block copies, then one jitted step.

        Args:
          plan: the scheduler's plan (``plan.seqs`` non-empty).
          rows: one ``RowInput`` per ``plan.seqs`` entry, in order.

        Returns:
          StepOutput host arrays, row ``i`` for ``plan.seqs[i]``.
        """
        inputs = batch.build(plan, self.cache_config, self.sched_config,
                             max_drafts=self.max_drafts)
        num_logprobs = next(b for b in _LOGPROB_BUCKETS
                            if b >= max((r.params.logprobs or 0) for r in rows))
        width = inputs.logits_indices.shape[1]
        sampling = self.sampling_tensors(verify_rows(plan, rows, width) if width > 1 else rows,
                                         len(inputs.seq_lens) * width)
        self.transfer(plan)
        self._apply_copies(plan.copy_ops)
        t_device = time.perf_counter()
        step_fn = self._step_fn if plan.observe else self._blind_step_fn
        variants = step_fn._cache_size()
        decode_only = self.split_k_decode and width == 1 and inputs.num_tokens == inputs.num_seqs
        key = (step_fn, len(inputs.token_ids), len(inputs.seq_lens), width, num_logprobs,
               decode_only)
        if key not in self._variants_run:
            logger.info("compiling the step for %d tokens, %d sequences (width %d, %d logprobs, "
                        "decode-only %s): its first use", *key[1:])
            self._variants_run.add(key)
        self.cache, *out = step_fn(
            self.params, self.cache, *self._to_device((
                DeviceStepInput.from_host(inputs), sampling,
                step_rng(self._seed, self.num_steps))), num_logprobs=num_logprobs,
            decode_only=decode_only)
        tokens, accepted, logprobs, (top_ids, top_vals), mass = out
        out = StepOutput(*(self._to_host(x)
                           for x in (tokens, accepted, logprobs, top_ids, top_vals)),
                         block_mass=None if mass is None else self._to_host(mass))
        elapsed = time.perf_counter() - t_device
        self.device_time += elapsed
        if step_fn._cache_size() > variants:   # compiled (or loaded from disk) on demand
            logger.info("step variant %d (%d tokens, %d sequences, width %d, %d logprobs) "
                        "compiled on demand: %.2f s with its first step", self.num_compilations(),
                        len(inputs.token_ids), len(inputs.seq_lens), width, num_logprobs, elapsed)
        self.num_steps += 1
        return out

    def attach_offload(self, offload: KVOffload, cache, preemption_mode: str) -> None:
        """Hands the runner a host KV tier built over its pool (``KVOffload.build``, which
        returns the pool it measured with); the scheduler's ``cache_config`` gains the tier
        and ``preemption_mode`` (``OffloadArgs.preemption_mode``)."""
        self.offload, self.cache = offload, cache
        self.cache_config = dataclasses.replace(
            self.cache_config, host_blocks=offload.num_slots, preemption_mode=preemption_mode,
            swap_supported=not self.kv_spec.format.kivi)

    def transfer(self, plan: StepPlan) -> None:
        """Applies a plan's host-tier transfers (``KVOffload.transfer``)."""
        if self.offload is None:
            if plan.swap_out or plan.swap_in or plan.disk_loads:
                raise ValueError("the plan moves KV to a host tier this engine does not have")
            return
        self.cache = self.offload.transfer(self.cache, plan)

    def _apply_copies(self, copy_ops: Sequence[tuple[int, int]]) -> None:
        """Applies a plan's copy-on-write block copies on the device, all at once."""
        if copy_ops:
            n = 1 << (len(copy_ops) - 1).bit_length()   # pad to a power of two: few compiles
            ops = np.zeros((n, 2), np.int32)            # padding copies null -> null
            ops[:len(copy_ops)] = copy_ops
            self.cache = copy_blocks(self.cache, jnp.asarray(ops[:, 0]), jnp.asarray(ops[:, 1]))

    def close(self) -> None:
        """Frees device memory (params and cache); the runner cannot be used afterwards."""
        for leaf in jax.tree_util.tree_leaves((self.params, self.cache)):
            leaf.delete()
        self.params = self.cache = None
