"""GPU check of the jaxkv Pallas attention kernels: correctness, decode bandwidth, prefill speed,
and the engine end to end.

Run from the repository root (finishes in under 9 minutes on an H200; sections (a)-(e) need only
jax + numpy, (f) jaxkv's engine imports: safetensors, tokenizers, jinja2, tqdm, which the H200
image holds; ``gguf``, which it lacks, is imported only when a GGUF file is read, and (f) does not
read one):

    PYTHONPATH=. python3 bench/gpu_check.py                 # writes $OUT/gpu_check.{md,json}
    PYTHONPATH=. python3 bench/gpu_check.py --dry-run       # tiny sizes, interpret mode, CPU

Sections:
  (a) every kernel variant vs jaxkv.attention.reference.paged_attention_reference at real sizes; plus KIVI
      int4/int2 pools (bf16 q, head_dim 128; ragged and split-K decode kernels vs the reference
      on the same QuantizedPages): a fully sealed quantize_pages pool and a pool written through
      cache.init_cache + cache.write whose sequences end in unsealed blocks (the residual path);
  (b) decode: batch x context x GQA grid, bf16, head_dim 128; achieved GB/s = KV bytes read / time,
      as a fraction of the device-to-device copy bandwidth measured in the same run, next to the
      ragged kernel on the same decode batch and jax.experimental.pallas.ops.gpu.paged_attention;
  (b2) quantized decode: fp8_e4m3, int8 (bf16 per-token scales) and KIVI int4, int2 (keys per
      channel, values per token in groups of 32) pools at 8k and 32k context, GQA 4, the bf16
      rows' batches and q: ms per call, GB/s over the bytes the kernel reads (codes + scales +
      zero points + int32 res_slot per page + the residual's null slot), the speedup over the
      bf16 row of the same batch, and issue #6's targets at 32k (>= 1.7x fp8/int8, >= 2.5x int4)
      as pass/fail;
  (b3) Quest sparse decode (jaxkv.attention.quest + jaxkv.attention.pallas.sparse) against the dense split-K
      decode kernel at 8k and 32k context, bf16, GQA 4, token budgets 512 and 2048 (sinks and
      the recent window included): the selected pages' bytes + the key bounds' bytes actually
      read, GB/s, speed-up over dense paged_decode_attention, for the kernel alone (selection
      given) and for the whole step (scores + top pages + kernel), and the kernel vs the sparse
      reference on the same selection (run after (c), before (d));
  (b4) kept-blocks decode (issue 13): tables keeping 25% of each sequence's blocks (scattered, the
      last one kept; the rest the null block, as H2O / SnapKV leave them) at 8k and 32k context,
      bf16, GQA 4: the split-K decode kernel's kept walk (the default without a window) vs the
      dense walk of the same table (every logical tile, null blocks gathered and masked, forced
      by a window covering the whole context): the bytes each reads (kept pages' K+V vs every
      logical position's), ms, GB/s, speed-up, and the two outputs' max difference (run after
      (b), before (c));
  (c) prefill: one 8k-token causal prompt through the ragged kernel vs dense flash attention
      (pallas ops.gpu.attention.mha with K/V repeated to every head, and
      jax.nn.dot_product_attention);
  (d) a small tuning sweep of the kernels' configs, while time is left;
  (e) host KV offload (issue 14): device-to-host and host-to-device GB/s of 16-token all-layer
      block units of an 8B-class geometry (32 layers, 8 kv heads, head_dim 128, bf16: 2 MiB a
      block) through jaxkv.kvcache.host_pool.HostKVPool (the engine's path: jitted gather into
      numpy rows, rows -> device_put -> jitted donated scatter; staged through pinned_host
      buffers, the GPU default, and without them, copy_to_host_async), single
      blocks vs batches of 8 / 64 / 512, and a contiguous buffer moved by jax.device_put to
      ``memory_kind="pinned_host"`` vs a jitted copy whose output lives there (targets on H200:
      >= 40 GB/s D2H, >= 45 GB/s H2D); run after (c);
  (f) end to end (issue 16), run last: ``jaxkv.LLM`` on a random-weight model of SmolLM2-135M's
      geometry (30 layers, hidden 576, 9 q / 3 kv heads of 64, intermediate 1536, vocab 49152,
      tied embeddings, rope theta 1e5), written on the machine as an HF directory (config.json,
      bf16 safetensors, a word-level tokenizer over the whole vocabulary) and loaded by the
      engine's own loader; bf16, the engine's default attention (``pallas`` on GPU, recorded per
      row). Batch 1 / 16 / 64 of 128 random prompt ids and 128 greedy output tokens each
      (ignore_eos), after a warm-up generate of the same batch (compiles excluded; a recompile
      in the timed run is counted): output tokens/s over the whole run (prefill included), the
      mean decode step ms, and the host share of step time, (wall - device) / wall of each
      ``llm.step()``, device = the jitted step from dispatch to tokens on the host
      (bench/lib/step_timing.py, shared with bench/decode_step.py). A row whose requests do not get
      exactly 128 tokens fails the run.
Every timing runs the op ``inner`` times inside one jitted loop (each call feeds a scalar of its
output into the next q, so nothing is hoisted), repeated ``reps`` times: median and min/max are
per call. Every section is guarded: a failure is recorded in the report, the script goes on.
Time guards: no bf16 decode measurement starts after 300 s, no quantized one after 360 s, no
kept-blocks one after 380 s, no sweep one after 400 s, no sparse one after 420 s; (f) starts
only before 440 s, and no end-to-end row starts after 500 s or when the previous row's time
would carry it past 530 s. The speedup
targets are reported, not part of the exit status; a sparse row whose kernel disagrees with the
sparse reference, or a kept-blocks row whose two walks disagree, fails the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


from jaxkv.attention.pallas import (DecodeConfig, RaggedConfig, default_num_splits,
                                    paged_decode_attention, ragged_paged_attention)
from jaxkv.attention.reference import paged_attention_reference
from jaxkv.kvcache.spec import KV_FORMATS, KVCacheSpec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, for lib/
from lib.random_model import SPECIAL_TOKENS, write_random_model  # noqa: E402 - after the path
from lib.step_timing import timed_step  # noqa: E402

# (f): SmolLM2-135M's sizes (HF config.json fields); its other fields are in write_random_model
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)

TOL = {"float32": dict(atol=2e-4, rtol=2e-4), "bfloat16": dict(atol=2e-2, rtol=2e-2)}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Problem sizes of one run (real GPU sizes or the dry run's tiny ones)."""

    interpret: bool
    head_dim: int
    num_kv_heads: int
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    groups: tuple[int, ...]
    prefill_tokens: int
    copy_bytes: int
    reps: int
    target_s: float          # wall time of one timed repetition (sets the inner loop count)
    decode_until_s: float    # no new decode measurement starts after this many seconds
    sweep_until_s: float     # nor a tuning-sweep one (the whole run must stay < 9 minutes)
    correctness: tuple[dict, ...]
    sweep_block_kv: tuple[int, ...]
    sweep_launch: tuple[tuple[int, int], ...]     # (num_warps, num_stages)
    quant_contexts: tuple[int, ...] = ()          # contexts of the quantized decode rows
    quant_dtypes: tuple[str, ...] = ("fp8_e4m3", "int8", "int4", "int2")
    quant_groups: tuple[int, ...] = (4,)          # GQA groups of the quantized decode rows
    quant_until_s: float = 360.0  # no quantized decode row starts after this (bf16 rows: 300 s)
    target_context: int = 32768   # context at which QUANT_TARGETS are judged
    sparse_contexts: tuple[int, ...] = ()         # contexts of the Quest sparse decode rows
    sparse_batches: tuple[int, ...] = (8, 32)
    sparse_budgets: tuple[int, ...] = (512, 2048)  # tokens attended per (sequence, kv head)
    sparse_sinks: int = 16        # sink tokens always attended
    sparse_recent: int = 64       # recent tokens always attended (the current one included)
    sparse_until_s: float = 420.0  # no sparse decode row starts after this
    kept_contexts: tuple[int, ...] = ()           # (b4): contexts of the kept-blocks rows
    kept_batches: tuple[int, ...] = (8, 32)
    kept_fraction: float = 0.25    # blocks of each sequence its table keeps
    kept_until_s: float = 380.0    # no kept-blocks row starts after this
    offload_layers: int = 32       # (e): the block geometry moved to and from the host
    offload_kv_heads: int = 8
    offload_blocks: tuple[int, ...] = (1, 8, 64, 512)
    e2e_model: tuple[tuple[str, int], ...] = tuple(SMOLLM2_135M.items())  # (f): the model's sizes
    e2e_batches: tuple[int, ...] = (1, 16, 64)
    e2e_prompt: int = 128          # random prompt token ids per request
    e2e_tokens: int = 128          # output tokens per request (greedy, ignore_eos)
    e2e_warmup_tokens: int = 16    # the warm-up generate's (same batch and prompt length)
    e2e_impl: str | None = None    # attention_impl (None: the engine's default for the backend)
    e2e_start_until_s: float = 440.0  # (f) does not start after this
    e2e_until_s: float = 500.0     # no end-to-end row starts after this,
    e2e_end_s: float = 530.0       # nor one the previous row's time would carry past this


REAL = Settings(
    interpret=False, head_dim=128, num_kv_heads=8, block_size=16,
    batches=(1, 8, 32, 128), contexts=(512, 2048, 8192, 32768), groups=(4, 8),
    prefill_tokens=8192, copy_bytes=2 << 30, reps=5, target_s=0.02,
    decode_until_s=300.0, sweep_until_s=400.0,
    correctness=(
        dict(q_lens=(1000, 1, 1, 300, 1, 1, 1024, 1),
             kv_lens=(1000, 4000, 8191, 2348, 17, 1, 1040, 32768)),
    ),
    sweep_block_kv=(32, 64, 128), sweep_launch=((4, 2), (4, 3), (8, 2)),
    quant_contexts=(8192, 32768), sparse_contexts=(8192, 32768), kept_contexts=(8192, 32768))
# head_dim 64: the smallest at which int2 is served (chunks of head_dim / 4 >= 16 channels)
DRY = Settings(
    interpret=True, head_dim=64, num_kv_heads=2, block_size=8,
    batches=(1, 2), contexts=(64,), groups=(4,),
    prefill_tokens=64, copy_bytes=1 << 20, reps=2, target_s=0.0,
    # the dry run checks that every row runs, not how fast: no time budget (a loaded CPU in CI
    # would otherwise drop the last rows)
    decode_until_s=math.inf, sweep_until_s=math.inf,
    correctness=(dict(q_lens=(5, 1, 1), kv_lens=(5, 30, 9)),),
    sweep_block_kv=(16,), sweep_launch=((4, 2),), quant_contexts=(64,), quant_until_s=math.inf,
    target_context=64, sparse_contexts=(64,), sparse_batches=(2,), sparse_budgets=(32, 48),
    sparse_sinks=8, sparse_recent=8, sparse_until_s=math.inf,
    kept_contexts=(64,), kept_batches=(2,), kept_until_s=math.inf,
    offload_layers=2, offload_kv_heads=2, offload_blocks=(1, 8),
    e2e_model=tuple(dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1).items()),
    e2e_batches=(1, 4), e2e_prompt=16, e2e_tokens=4, e2e_warmup_tokens=2, e2e_impl="pallas",
    e2e_start_until_s=math.inf, e2e_until_s=math.inf, e2e_end_s=math.inf)

# Issue #6: decode speedup over the bf16 pool of the same batch at ``target_context`` (32k).
QUANT_TARGETS = {"fp8_e4m3": 1.7, "int8": 1.7, "int4": 2.5}
# packed KIVI pools (int4, int2): K per channel, V per token (G = 32 at head_dim 128)
KIVI_DTYPES = tuple(name for name, f in KV_FORMATS.items() if f.kivi)


class Clock:
    """Seconds since the run started."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def make_paged(key, kv_lens, *, Hkv, D, bs, dtype):
    """Pools [P, bs, Hkv, D] and int32 block tables from a random permutation of page ids 1.."""
    blocks = [-(-n // bs) for n in kv_lens]
    num_blocks = 1 + sum(blocks)
    max_blocks = max(blocks)
    perm = np.random.default_rng(0).permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(kv_lens), max_blocks), np.int32)
    used = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    kk, kv = jax.random.split(key)
    shape = (num_blocks, bs, Hkv, D)
    return (jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype),
            jnp.asarray(tables), jnp.asarray(np.asarray(kv_lens, np.int32)))


def max_err(got, want):
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


def is_close(got, want, dtype_name):
    tol = TOL[dtype_name]
    return bool(np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                            atol=tol["atol"], rtol=tol["rtol"]))


@functools.partial(jax.jit, static_argnames=("kv_cache_dtype",))
def quantize_kv(k, v, kv_cache_dtype: str):
    """(K, V) ``QuantizedPages`` of float pools, every block sealed: fp8/int8 per token; KIVI
    int4/int2 keys per channel (over a block's tokens), values per token (groups of 32)."""
    from jaxkv.kvcache.pools import quantize_pages

    kivi = kv_cache_dtype in KIVI_DTYPES
    return (quantize_pages(k, kv_cache_dtype, axis="channel" if kivi else "token"),
            quantize_pages(v, kv_cache_dtype, axis="token"))


def written_kivi_pools(k, v, tables, lens, kv_cache_dtype: str):
    """KIVI (K, V) pools built the serving way: ``init_cache`` + one ``cache.write`` of every
    token of every sequence (the values of the float pools ``k``, ``v`` at the same slots).
    Blocks filled to the end are sealed (codes); the tail block of a sequence whose length is
    not a multiple of block_size stays unsealed, in the full-precision residual."""
    from jaxkv.kvcache import pages as kvcache

    num_blocks, bs, hkv, d = k.shape
    tables_np, lens_np = np.asarray(tables), np.asarray(lens)
    pos = [np.arange(n) for n in lens_np]
    blk = np.concatenate([tables_np[s, p // bs] for s, p in enumerate(pos)]).astype(np.int32)
    off = np.concatenate([p % bs for p in pos]).astype(np.int32)
    c = kvcache.init_cache(KVCacheSpec(num_layers=1, num_blocks=num_blocks, block_size=bs,
                                       num_kv_heads=hkv, head_dim=d, dtype=jnp.dtype(k.dtype).name,
                                       kv_cache_dtype=kv_cache_dtype,
                                       num_residual_slots=len(lens_np)))
    blk, off = jnp.asarray(blk), jnp.asarray(off)
    c = jax.jit(kvcache.write, static_argnums=1)(c, 0, k[blk, off], v[blk, off], blk * bs + off)
    return c.k[0], c.v[0]


def wide_offsets(pool):
    """``pool`` padded with unreferenced blocks where Pallas' Triton lowering would overflow.

    The lowering indexes an array with 32-bit element offsets unless it is over 2**32 bytes,
    and the offsets are signed: a 1-byte code array of 2**31..2**32 bytes (int4 codes at batch
    128 x 32k context: 262145 blocks of 8192 bytes) would read its top pages at negative
    offsets. Padding every [num_blocks, ...] array past 2**32 bytes switches it to 64-bit
    offsets; the padded blocks are never read, so neither time nor bytes read change.
    """
    if not hasattr(pool, "data") or not 2**31 <= pool.data.nbytes <= 2**32 \
            or pool.data.dtype.itemsize != 1:
        return pool
    n = pool.data.shape[0]
    extra = 2**32 // (pool.data.nbytes // n) + 1 - n
    pad = {f: jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1))
           for f in ("data", "scale", "zero", "res_slot", "sealed")
           if (a := getattr(pool, f)) is not None and a.shape[0] == n}
    return dataclasses.replace(pool, **pad)


def read_bytes(pool, pages_read: int) -> int:
    """Bytes the kernels read from one pool for ``pages_read`` pages: a float pool's pages; a
    ``QuantizedPages``' codes + scales + zero points (per-page slices of every [num_blocks, ...]
    array: fp8/int8 per-token scales; KIVI per-channel [N, 1, Hkv, D] or per-token
    [N, bs, Hkv, D / G] bf16 scale and zero, the int32 res_slot) + its residual pool once (for a
    ``quantize_pages`` pool only the null slot, which every sealed page reads, and one empty
    slot)."""
    if not hasattr(pool, "data"):
        return pool.nbytes // pool.shape[0] * pages_read
    per_page = sum(a.nbytes for a in (pool.data, pool.scale, pool.zero, pool.res_slot)
                   if a is not None) // pool.data.shape[0]
    return per_page * pages_read + (0 if pool.residual is None else pool.residual.nbytes)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def looped(fn, inner: int):
    """jit(q, *rest) -> runs fn ``inner`` times, each call's output (q's shape) the next q.

    Feeding the whole output back keeps every call, and all of each output, live: nothing can be
    hoisted out of the loop or sliced away.
    """

    def run(q, *rest):
        def body(_, q):
            return fn(q, *rest).reshape(q.shape).astype(q.dtype)
        return jax.lax.fori_loop(0, inner, body, q)

    return jax.jit(run)


def time_op(fn, args, *, settings: Settings, est_s: float):
    """Per-call seconds of fn(*args): (median, min, max, inner) over settings.reps repetitions."""
    inner = max(1, min(200, int(settings.target_s / max(est_s, 1e-6))))
    run = looped(fn, inner)
    jax.block_until_ready(run(*args))                         # compile + warm up
    times = []
    for _ in range(settings.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t0) / inner)
    return float(np.median(times)), float(min(times)), float(max(times)), inner


def copy_bandwidth(settings: Settings) -> float:
    """Device-to-device copy bandwidth in GB/s: x + 1 reads and writes copy_bytes each."""
    x = jnp.zeros((settings.copy_bytes // 2,), jnp.bfloat16)
    est = 2 * settings.copy_bytes / 3e12
    med, _, _, _ = time_op(lambda x: x + 1, (x,), settings=settings, est_s=est)
    return 2 * settings.copy_bytes / med / 1e9


# --------------------------------------------------------------------------------------------
# (a) correctness
# --------------------------------------------------------------------------------------------


def check_correctness(settings: Settings, peer, errors: list[str]):
    """{"ours": rows, "peer": rows}; a failing peer is appended to ``errors``."""
    rows, peer_rows = [], []
    D, Hkv, bs = settings.head_dim, settings.num_kv_heads, settings.block_size
    Hq = 4 * Hkv
    window = 7 if settings.interpret else 1024
    variants = [("plain", {}), ("window+sinks", dict(sliding_window=window, num_sinks=4)),
                ("softcap", dict(soft_cap=30.0))]
    for case in settings.correctness:
        q_lens, kv_lens = case["q_lens"], case["kv_lens"]
        for dtype in (jnp.bfloat16, jnp.float32):
            name = jnp.dtype(dtype).name
            k, v, tables, lens = make_paged(jax.random.key(1), kv_lens, Hkv=Hkv, D=D, bs=bs,
                                            dtype=dtype)
            T = sum(q_lens) + 5
            q = jax.random.normal(jax.random.key(2), (T, Hq, D), dtype)
            qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
            n = sum(q_lens)
            S = len(kv_lens)
            qd = q[:S]
            qsl_d = jnp.arange(S + 1, dtype=jnp.int32)
            for label, opts in variants:
                want = paged_attention_reference(q, k, v, tables, lens, qsl, **opts)
                got = ragged_paged_attention(q, k, v, tables, lens, qsl, **opts,
                                             interpret=settings.interpret)
                rows.append(dict(kernel="ragged", variant=label, dtype=name,
                                 max_err=max_err(got[:n], want[:n]),
                                 ok=is_close(got[:n], want[:n], name)
                                 and bool(jnp.all(got[n:] == 0))))
                want_d = paged_attention_reference(qd, k, v, tables, lens, qsl_d, **opts)
                for splits in (1, None):
                    got_d = paged_decode_attention(qd, k, v, tables, lens, num_splits=splits,
                                                   **opts, interpret=settings.interpret)
                    rows.append(dict(kernel=f"decode splits={splits or 'auto'}", variant=label,
                                     dtype=name, max_err=max_err(got_d, want_d),
                                     ok=is_close(got_d, want_d, name)))
            if dtype == jnp.bfloat16:
                rows += check_kivi(settings, (k, v, tables, lens), q, qsl, n, errors)
            if peer is not None and dtype == jnp.bfloat16:
                want_d = paged_attention_reference(qd, k, v, tables, lens, qsl_d)
                try:
                    got_p = peer(qd, to_hnd(k), to_hnd(v), tables, lens)
                    peer_rows.append(dict(kernel="jax paged_attention (peer)", variant="plain",
                                          dtype=name, max_err=max_err(got_p, want_d),
                                          ok=is_close(got_p, want_d, name)))
                except Exception as e:  # noqa: BLE001 - the peer is not under test
                    errors.append(f"peer correctness: {type(e).__name__}: {str(e)[:200]}")
    return dict(ours=rows, peer=peer_rows)


def check_kivi(settings: Settings, paged, q, qsl, n: int, errors: list[str]) -> list[dict]:
    """Rows of the KIVI int4/int2 pools (K per channel, V per token): the ragged kernel and the
    split-K decode kernel (default splits) vs the reference on the same ``QuantizedPages``, for
    a fully sealed ``quantize_pages`` pool (what the decode rows time) and a pool written through
    ``cache.write`` whose sequences end in unsealed blocks (read from the residual)."""
    k, v, tables, lens = paged
    S = lens.shape[0]
    qd, qsl_d = q[:S], jnp.arange(S + 1, dtype=jnp.int32)
    tails = int(np.sum(np.asarray(lens) % settings.block_size != 0))
    rows = []
    for kv in KIVI_DTYPES:
        for label in (f"{kv} sealed (quantize_pages)", f"{kv} written, {tails} unsealed tails"):
            try:
                if "sealed (" in label:
                    kq, vq = quantize_kv(k, v, kv)
                else:
                    kq, vq = written_kivi_pools(k, v, tables, lens, kv)
                    got_tails = int(jnp.sum(kq.res_slot > 0))
                    if got_tails != tails:
                        raise AssertionError(f"{got_tails} unsealed blocks, expected {tails}")
                want = paged_attention_reference(q, kq, vq, tables, lens, qsl)
                got = ragged_paged_attention(q, kq, vq, tables, lens, qsl,
                                             interpret=settings.interpret)
                rows.append(dict(kernel="ragged", variant=label, dtype="bfloat16",
                                 max_err=max_err(got[:n], want[:n]),
                                 ok=is_close(got[:n], want[:n], "bfloat16")
                                 and bool(jnp.all(got[n:] == 0))))
                want_d = paged_attention_reference(qd, kq, vq, tables, lens, qsl_d)
                got_d = paged_decode_attention(qd, kq, vq, tables, lens,
                                               interpret=settings.interpret)
                rows.append(dict(kernel="decode splits=auto", variant=label, dtype="bfloat16",
                                 max_err=max_err(got_d, want_d),
                                 ok=is_close(got_d, want_d, "bfloat16")))
                del kq, vq
            except Exception as e:  # noqa: BLE001 - recorded, the other pools go on
                traceback.print_exc()
                errors.append(f"correctness {label}: {type(e).__name__}: {str(e)[:200]}")
                rows.append(dict(kernel="ragged + decode", variant=label, dtype="bfloat16",
                                 max_err=float("nan"), ok=False))
    return rows


# --------------------------------------------------------------------------------------------
# (b) decode bandwidth
# --------------------------------------------------------------------------------------------


def to_hnd(pool):
    """[P, bs, Hkv, D] (ours, NHD) -> [Hkv, P, bs, D] (the peer's HND layout)."""
    return jnp.transpose(pool, (2, 0, 1, 3))


def ragged_decode(q, k, v, tables, lens, *, interpret):
    """The ragged kernel on a decode batch: one query token per sequence."""
    qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return ragged_paged_attention(q, k, v, tables, lens, qsl, interpret=interpret)


def make_peer(settings: Settings):
    """jax.experimental.pallas.ops.gpu.paged_attention(q, k_hnd, v_hnd, tables, lens)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    def peer(q, k_hnd, v_hnd, tables, lens):
        pages = tables.shape[1]
        k_splits = math.gcd(16, pages)
        ppcb = math.gcd(8, pages // k_splits)
        scale = 1.0 / math.sqrt(q.shape[-1])
        return jpa.paged_attention((q * scale).astype(q.dtype), k_hnd, v_hnd, tables, lens,
                                   k_splits=k_splits, pages_per_compute_block=ppcb,
                                   interpret=settings.interpret)

    return peer


def bench_decode(settings: Settings, clock: Clock, peer, copy_gbps: float) -> list[dict]:
    rows = []
    D, Hkv, bs = settings.head_dim, settings.num_kv_heads, settings.block_size
    dtype = jnp.bfloat16
    for ctx in settings.contexts:
        max_b = max(settings.batches)
        if clock.elapsed() > settings.decode_until_s:
            break
        k, v, tables_all, _ = make_paged(jax.random.key(ctx), [ctx] * max_b, Hkv=Hkv, D=D,
                                         bs=bs, dtype=dtype)
        k_hnd, v_hnd = to_hnd(k), to_hnd(v)
        bf16_rows = {}
        for G in settings.groups:
            for B in settings.batches:
                if clock.elapsed() > settings.decode_until_s:
                    break
                tables = tables_all[:B]
                lens = jnp.full((B,), ctx, jnp.int32)
                q = jax.random.normal(jax.random.key(B), (B, G * Hkv, D), dtype)
                kv_bytes = B * ctx * Hkv * D * 2 * 2
                est = kv_bytes / 3e12 + 5e-6
                row = dict(batch=B, context=ctx, group=G, kv_bytes=kv_bytes)
                ours = functools.partial(paged_decode_attention, interpret=settings.interpret)
                ragged = functools.partial(ragged_decode, interpret=settings.interpret)
                timed = [("ours", ours, (q, k, v, tables, lens)),
                         ("ragged", ragged, (q, k, v, tables, lens))]
                if peer is not None:
                    timed.append(("peer", peer, (q, k_hnd, v_hnd, tables, lens)))
                for name, fn, args in timed:
                    try:
                        med, lo, hi, inner = time_op(fn, args, settings=settings, est_s=est)
                        gbps = kv_bytes / med / 1e9
                        row.update({f"{name}_ms": med * 1e3, f"{name}_min_ms": lo * 1e3,
                                    f"{name}_max_ms": hi * 1e3, f"{name}_gbps": gbps,
                                    f"{name}_frac_copy": gbps / copy_gbps})
                    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                        row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                bf16_rows[G, B] = row
                print(fmt_decode_row(row), flush=True)
        del k_hnd, v_hnd
        gc.collect()
        if ctx in settings.quant_contexts:
            rows += bench_quant_decode(settings, clock, bf16_rows, k, v, tables_all, copy_gbps)
        del k, v
        gc.collect()
    return rows


def bench_quant_decode(settings: Settings, clock: Clock, bf16_rows: dict, k, v, tables_all,
                       copy_gbps: float) -> list[dict]:
    """Decode rows of the quantized pools (each dtype quantized once from the bf16 pools of the
    context) for the batches of the bf16 rows at GQA ``quant_groups``, same q: ms per call, GB/s
    over the bytes the kernel reads (``read_bytes``) and the speedup over the bf16 row's time."""
    from jaxkv.attention.pallas.kv_format import check_pallas_support

    rows = []
    D, Hkv, bs = settings.head_dim, settings.num_kv_heads, settings.block_size
    for kv in settings.quant_dtypes:
        if clock.elapsed() > settings.quant_until_s:
            break
        try:
            check_pallas_support(KVCacheSpec(num_layers=1, num_blocks=2, block_size=bs,
                                             num_kv_heads=Hkv, head_dim=D, dtype="bfloat16",
                                             kv_cache_dtype=kv))
        except ValueError as e:
            print(f"skipping {kv} decode rows: {e}", flush=True)
            continue
        kq, vq = (wide_offsets(p) for p in quantize_kv(k, v, kv))
        for G in settings.quant_groups:
            for B in settings.batches:
                bf16 = bf16_rows.get((G, B))
                if bf16 is None or "ours_ms" not in bf16:
                    continue
                if clock.elapsed() > settings.quant_until_s:
                    break
                ctx = bf16["context"]
                tables, lens = tables_all[:B], jnp.full((B,), ctx, jnp.int32)
                q = jax.random.normal(jax.random.key(B), (B, G * Hkv, D), jnp.bfloat16)
                pages = B * -(-ctx // bs)
                kv_bytes = read_bytes(kq, pages) + read_bytes(vq, pages)
                row = dict(batch=B, context=ctx, group=G, kv_bytes=kv_bytes, kv_cache_dtype=kv,
                           bf16_ms=bf16["ours_ms"], bf16_kv_bytes=bf16["kv_bytes"])
                fn = functools.partial(paged_decode_attention, interpret=settings.interpret)
                try:
                    med, lo, hi, _ = time_op(fn, (q, kq, vq, tables, lens), settings=settings,
                                             est_s=kv_bytes / 3e12 + 5e-6)
                    gbps = kv_bytes / med / 1e9
                    row.update(ours_ms=med * 1e3, ours_min_ms=lo * 1e3, ours_max_ms=hi * 1e3,
                               ours_gbps=gbps, ours_frac_copy=gbps / copy_gbps,
                               speedup_vs_bf16=bf16["ours_ms"] / (med * 1e3))
                    target = QUANT_TARGETS.get(kv) if ctx == settings.target_context else None
                    if target is not None:
                        row.update(target=target, target_met=row["speedup_vs_bf16"] >= target)
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    row["ours_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(fmt_quant_row(row), flush=True)
        del kq, vq
        gc.collect()
    return rows


# --------------------------------------------------------------------------------------------
# (b3) Quest sparse decode
# --------------------------------------------------------------------------------------------


def bench_sparse(settings: Settings, clock: Clock, copy_gbps: float) -> list[dict]:
    """Quest sparse decode rows: per (context, batch) the dense split-K kernel, then per token
    budget the pages Quest selects (``quest_select`` over the pool's ``key_bounds``), the sparse
    kernel vs ``sparse_decode_reference`` on them, and the timings of the kernel alone and of the
    whole step (scores + selection + kernel). Bytes read: the selected pages' K and V
    (pages x block_size x head_dim x 2 B x 2, summed over sequences and kv heads) for the kernel,
    plus the f32 kmin/kmax of every page of every sequence for the whole step."""
    from jaxkv.attention.pallas import sparse_paged_decode_attention
    from jaxkv.attention.quest import key_bounds, quest_select, sparse_decode_reference

    rows = []
    D, Hkv, bs = settings.head_dim, settings.num_kv_heads, settings.block_size
    G, dtype = 4, jnp.bfloat16
    page_bytes = bs * D * jnp.dtype(dtype).itemsize * 2          # K + V of one page, one head
    for ctx in settings.sparse_contexts:
        for B in settings.sparse_batches:
            if clock.elapsed() > settings.sparse_until_s:
                return rows
            k, v, tables, lens = make_paged(jax.random.key(100 + ctx), [ctx] * B, Hkv=Hkv, D=D,
                                            bs=bs, dtype=dtype)
            q = jax.random.normal(jax.random.key(B), (B, G * Hkv, D), dtype)
            bounds = jax.jit(key_bounds)(k, tables, lens)
            dense_bytes = B * ctx * Hkv * D * 2 * 2
            bounds_bytes = 2 * tables.size * Hkv * D * 4
            dense = functools.partial(paged_decode_attention, interpret=settings.interpret)
            try:
                dense_s, _, _, _ = time_op(dense, (q, k, v, tables, lens), settings=settings,
                                           est_s=dense_bytes / 3e12 + 5e-6)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                rows.append(dict(batch=B, context=ctx, group=G,
                                 dense_error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            for budget_tokens in settings.sparse_budgets:
                if clock.elapsed() > settings.sparse_until_s:
                    return rows
                opts = dict(budget=budget_tokens // bs, num_sinks=settings.sparse_sinks,
                            recent=settings.sparse_recent)
                row = dict(batch=B, context=ctx, group=G, budget_tokens=budget_tokens,
                           dense_ms=dense_s * 1e3, dense_bytes=dense_bytes,
                           dense_gbps=dense_bytes / dense_s / 1e9)
                try:
                    pages, count = jax.jit(functools.partial(quest_select, **opts))(
                        q, k, tables, lens, bounds=bounds)
                    kernel = functools.partial(sparse_paged_decode_attention,
                                               interpret=settings.interpret)
                    got = kernel(q, k, v, tables, lens, pages, count)
                    want = sparse_decode_reference(q, k, v, tables, lens, pages, count)
                    kv_read = int(jnp.sum(count)) * page_bytes
                    row.update(pages_read=int(jnp.sum(count)), kernel_bytes=kv_read,
                               quest_bytes=kv_read + bounds_bytes, max_err=max_err(got, want),
                               ok=is_close(got, want, "bfloat16"))

                    def quest(q, k, v, tables, lens, bounds):
                        sel = quest_select(q, k, tables, lens, bounds=bounds, **opts)
                        return kernel(q, k, v, tables, lens, *sel)

                    for name, fn, args, nbytes in (
                            ("kernel", kernel, (q, k, v, tables, lens, pages, count), kv_read),
                            ("quest", quest, (q, k, v, tables, lens, bounds),
                             kv_read + bounds_bytes)):
                        med, lo, hi, _ = time_op(fn, args, settings=settings,
                                                 est_s=nbytes / 3e12 + 5e-6)
                        row.update({f"{name}_ms": med * 1e3, f"{name}_min_ms": lo * 1e3,
                                    f"{name}_max_ms": hi * 1e3,
                                    f"{name}_gbps": nbytes / med / 1e9,
                                    f"{name}_frac_copy": nbytes / med / 1e9 / copy_gbps,
                                    f"{name}_speedup": dense_s / med})
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(fmt_sparse_row(row), flush=True)
            del k, v, bounds
            gc.collect()
    return rows


# --------------------------------------------------------------------------------------------
# (b4) kept-blocks decode
# --------------------------------------------------------------------------------------------


def thin_tables(tables, kv_lens, *, bs: int, fraction: float, seed: int):
    """int32 tables keeping ``round(fraction * blocks)`` of each sequence's blocks (its last one
    and a random choice of the others, at least 1), the rest set to the null block 0."""
    rng = np.random.default_rng(seed)
    tables = np.array(tables)
    for s, n in enumerate(np.asarray(kv_lens)):
        nb = -(-int(n) // bs)
        keep = max(1, round(fraction * nb))
        kept = np.append(rng.choice(nb - 1, keep - 1, replace=False), nb - 1)
        drop = np.setdiff1d(np.arange(nb), kept)
        tables[s, drop] = 0
    return jnp.asarray(tables)


def bench_kept(settings: Settings, clock: Clock, copy_gbps: float) -> list[dict]:
    """Kept-blocks decode rows: per (context, batch), the split-K decode kernel on a table keeping
    ``kept_fraction`` of each sequence's blocks, walking the kept blocks (no window: the default)
    and walking every logical tile of the same table (``sliding_window=context``, which sees
    every position, so the same attention). Bytes: the kept pages' K+V for the kept walk, every
    logical position's K+V for the dense one (its null-block gathers hit one cached page, so
    its HBM traffic is nearer the kept bytes; the time is what it saves)."""
    rows = []
    D, Hkv, bs = settings.head_dim, settings.num_kv_heads, settings.block_size
    G, dtype = 4, jnp.bfloat16
    page_bytes = bs * Hkv * D * jnp.dtype(dtype).itemsize * 2          # K + V of one page
    for ctx in settings.kept_contexts:
        for B in settings.kept_batches:
            if clock.elapsed() > settings.kept_until_s:
                return rows
            k, v, full, lens = make_paged(jax.random.key(200 + ctx), [ctx] * B, Hkv=Hkv, D=D,
                                          bs=bs, dtype=dtype)
            tables = thin_tables(full, lens, bs=bs, fraction=settings.kept_fraction, seed=B)
            q = jax.random.normal(jax.random.key(B), (B, G * Hkv, D), dtype)
            kept_pages = int(jnp.sum(tables != 0))
            row = dict(batch=B, context=ctx, group=G, kept_pages=kept_pages,
                       logical_pages=int(full.size), kept_bytes=kept_pages * page_bytes,
                       dense_bytes=int(full.size) * page_bytes)
            walks = {"kept": functools.partial(paged_decode_attention,
                                               interpret=settings.interpret),
                     "dense": functools.partial(paged_decode_attention, sliding_window=ctx,
                                                interpret=settings.interpret)}
            try:
                outs = {name: fn(q, k, v, tables, lens) for name, fn in walks.items()}
                row.update(max_err=max_err(outs["kept"], outs["dense"]),
                           ok=is_close(outs["kept"], outs["dense"], "bfloat16"))
                for name, fn in walks.items():
                    nbytes = row[f"{name}_bytes"]
                    med, lo, hi, _ = time_op(fn, (q, k, v, tables, lens), settings=settings,
                                             est_s=nbytes / 3e12 + 5e-6)
                    row.update({f"{name}_ms": med * 1e3, f"{name}_min_ms": lo * 1e3,
                                f"{name}_max_ms": hi * 1e3, f"{name}_gbps": nbytes / med / 1e9,
                                f"{name}_frac_copy": nbytes / med / 1e9 / copy_gbps})
                row["speedup"] = row["dense_ms"] / row["kept_ms"]
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(fmt_kept_row(row), flush=True)
            del k, v
            gc.collect()
    return rows


# --------------------------------------------------------------------------------------------
# (c) prefill
# --------------------------------------------------------------------------------------------


def bench_prefill(settings: Settings) -> list[dict]:
    D, Hkv, bs = settings.head_dim, settings.num_kv_heads, settings.block_size
    T = settings.prefill_tokens
    Hq = 4 * Hkv
    dtype = jnp.bfloat16
    k, v, tables, lens = make_paged(jax.random.key(3), [T], Hkv=Hkv, D=D, bs=bs, dtype=dtype)
    q = jax.random.normal(jax.random.key(4), (T, Hq, D), dtype)
    qsl = jnp.asarray([0, T], jnp.int32)
    pos = jnp.arange(T)
    k_dense = k[tables[0, pos // bs], pos % bs][None]          # [1, T, Hkv, D]
    v_dense = v[tables[0, pos // bs], pos % bs][None]
    scale = 1.0 / math.sqrt(D)
    flops = 4 * Hq * D * T * (T + 1) / 2                        # causal: QK^T and PV
    est = flops / 300e12
    paged_args = (q, k, v, tables, lens, qsl)
    cases = [(f"jaxkv ragged (paged) {cfg or 'default'}",
              functools.partial(ragged_paged_attention, config=cfg, interpret=settings.interpret),
              paged_args)
             for cfg in (None, RaggedConfig(block_q=32, block_kv=64, num_warps=8, num_stages=2),
                         RaggedConfig(block_q=16, block_kv=128, num_warps=8, num_stages=3))]

    def mha(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention
        G = Hq // Hkv
        return attention.mha(q[None], jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2), None,
                             sm_scale=scale, causal=True, interpret=settings.interpret)

    impl = "xla" if settings.interpret else "cudnn"

    def dpa(q, k, v):
        return jax.nn.dot_product_attention(q[None], k, v, scale=scale, is_causal=True,
                                            implementation=impl)

    cases += [("pallas ops.gpu.attention.mha (dense, K/V repeated)", mha, (q, k_dense, v_dense)),
              (f"jax.nn.dot_product_attention (dense, {impl})", dpa, (q, k_dense, v_dense))]
    rows = []
    for name, fn, args in cases:
        row = dict(kernel=name, tokens=T, num_heads=Hq, num_kv_heads=Hkv, head_dim=D)
        try:
            med, lo, hi, _ = time_op(fn, args, settings=settings, est_s=est)
            row.update(ms=med * 1e3, min_ms=lo * 1e3, max_ms=hi * 1e3, tflops=flops / med / 1e12)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(row, flush=True)
    return rows


# --------------------------------------------------------------------------------------------
# (d) tuning sweep
# --------------------------------------------------------------------------------------------


def bench_offload(settings: Settings) -> list[dict]:
    """(e) host offload bandwidth: HostKVPool batches, then raw device_put vs jit to pinned host."""
    from jaxkv.kvcache.host_pool import HostKVPool
    from jaxkv.kvcache.pages import init_cache

    n_max = max(settings.offload_blocks)
    spec = KVCacheSpec(num_layers=settings.offload_layers, num_blocks=n_max + 1,
                       block_size=16, num_kv_heads=settings.offload_kv_heads,
                       head_dim=settings.head_dim, dtype="bfloat16")
    cache = init_cache(spec)
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    rows = []
    for staging in ("none", "pinned_host") if "pinned_host" in kinds else ("none",):
        pool = HostKVPool(cache, n_max, staging=staging)   # "auto" is pinned_host on a GPU
        for n in settings.offload_blocks:
            cache, d2h, h2d = pool.measure(cache, n, repeats=settings.reps)
            rows.append(dict(path=f"HostKVPool staging={staging}", blocks=n,
                             block_bytes=pool.block_bytes, d2h_gbps=d2h / 1e9,
                             h2d_gbps=h2d / 1e9))
        del pool
    del cache
    gc.collect()
    if "pinned_host" not in kinds:
        rows.append(dict(path="pinned_host", blocks=0, block_bytes=spec.block_bytes,
                         error=f"no pinned_host memory on {dev.platform} (has {sorted(kinds)})"))
        return rows
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    for n in settings.offload_blocks:
        x = jnp.ones((n, spec.block_bytes // 2), jnp.bfloat16)
        to_host = jax.jit(lambda a: a, out_shardings=host)
        to_dev = jax.jit(lambda a: a, out_shardings=on_dev)
        for path, d2h_fn, h2d_fn in (
                ("device_put pinned_host", lambda a: jax.device_put(a, host),
                 lambda a: jax.device_put(a, on_dev)),
                ("jit out_shardings pinned_host", to_host, to_dev)):
            jax.block_until_ready(h2d_fn(jax.block_until_ready(d2h_fn(x))))   # warm up
            out, back = [], []
            for _ in range(settings.reps):
                t0 = time.perf_counter()
                y = jax.block_until_ready(d2h_fn(x))
                t1 = time.perf_counter()
                jax.block_until_ready(h2d_fn(y))
                out.append(t1 - t0)
                back.append(time.perf_counter() - t1)
            rows.append(dict(path=path, blocks=n, block_bytes=spec.block_bytes,
                             d2h_gbps=x.nbytes / np.median(out) / 1e9,
                             h2d_gbps=x.nbytes / np.median(back) / 1e9))
    return rows


def sweep_decode(settings: Settings, clock: Clock, copy_gbps: float) -> list[dict]:
    D, Hkv, bs = settings.head_dim, settings.num_kv_heads, settings.block_size
    rows = []
    shapes = [(8, settings.contexts[-1]), (max(settings.batches), settings.contexts[0])]
    for B, ctx in shapes:
        k, v, tables, lens = make_paged(jax.random.key(5), [ctx] * B, Hkv=Hkv, D=D, bs=bs,
                                        dtype=jnp.bfloat16)
        q = jax.random.normal(jax.random.key(6), (B, 4 * Hkv, D), jnp.bfloat16)
        kv_bytes = B * ctx * Hkv * D * 4
        for block_kv in settings.sweep_block_kv:
            for num_warps, num_stages in settings.sweep_launch:
                auto = default_num_splits(B, Hkv, ctx, block_kv)
                for splits in (None, 2 * auto):
                    if clock.elapsed() > settings.sweep_until_s:
                        return rows
                    cfg = DecodeConfig(block_kv=block_kv, num_warps=num_warps,
                                       num_stages=num_stages)
                    row = dict(batch=B, context=ctx, config=str(cfg), num_splits=splits or "auto")
                    try:
                        fn = functools.partial(paged_decode_attention, config=cfg,
                                               num_splits=splits, interpret=settings.interpret)
                        med, _, _, _ = time_op(fn, (q, k, v, tables, lens), settings=settings,
                                               est_s=kv_bytes / 3e12)
                        row.update(ms=med * 1e3, gbps=kv_bytes / med / 1e9,
                                   frac_copy=kv_bytes / med / 1e9 / copy_gbps)
                    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(row)
                    print(row, flush=True)
        del k, v
        gc.collect()
    return rows


# --------------------------------------------------------------------------------------------
# (f) end to end
# --------------------------------------------------------------------------------------------

def bench_e2e(settings: Settings, clock: Clock) -> list[dict]:
    """End-to-end rows: ``jaxkv.LLM`` on a random model of SmolLM2-135M's geometry (bf16, the
    engine's default attention for the backend), per batch: ``e2e_prompt`` random prompt ids and
    ``e2e_tokens`` greedy output tokens (ignore_eos) per request, after a warm-up generate of the
    same batch and prompt length (compiles excluded; ``recompiles`` counts any in the timed run).
    Tokens/s = output tokens / wall time from the first ``add_request`` to the last step; each
    ``llm.step()``'s wall and device time as bench/lib/step_timing.py measures them; the host share
    = (wall - device) / wall: the median over the decode-only steps, and over all steps' sums."""
    if clock.elapsed() > settings.e2e_start_until_s:
        return []
    try:
        from jaxkv import LLM, SamplingParams
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{e}: jaxkv's engine imports it; carry its wheel "
                                  "(bench/README.md, gpu_check.py)") from e
    sizes = dict(settings.e2e_model)
    P, N, B_max, bs = settings.e2e_prompt, settings.e2e_tokens, max(settings.e2e_batches), 16
    label = ("SmolLM2-135M's geometry" if sizes == SMOLLM2_135M else "tiny") + \
        (f" (L{sizes['num_hidden_layers']} E{sizes['hidden_size']} "
         f"F{sizes['intermediate_size']} H{sizes['num_attention_heads']}/"
         f"{sizes['num_key_value_heads']} V{sizes['vocab_size']}), random weights")
    rng = np.random.default_rng(0)

    def prompts(B):   # fresh ids each call: the timed run gets no prefix-cache hit from warm-up
        return [{"prompt_token_ids": rng.integers(len(SPECIAL_TOKENS), sizes["vocab_size"],
                                                  P).tolist()} for _ in range(B)]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        llm = LLM(write_random_model(os.path.join(tmp, "model"), sizes), dtype="bfloat16",
                  seed=0, max_model_len=P + N, max_num_seqs=B_max,
                  max_num_batched_tokens=B_max * P,    # a batch's prompts prefill in one step
                  block_size=bs, num_kv_blocks=1 + B_max * -(-(P + N) // bs),
                  attention_impl=settings.e2e_impl, interpret=settings.interpret,
                  compilation_cache=False)
        build_s = time.perf_counter() - t0
        runner = llm.engine.runner
        warm = SamplingParams(temperature=0.0, max_tokens=settings.e2e_warmup_tokens,
                              ignore_eos=True)
        params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
        last_row_s = 0.0
        for B in settings.e2e_batches:
            if clock.elapsed() > settings.e2e_until_s \
                    or clock.elapsed() + last_row_s > settings.e2e_end_s:
                break
            t_row = time.perf_counter()
            row = dict(batch=B, prompt_tokens=P, output_tokens=N, model=label,
                       attention_impl=runner.attention_impl, dtype=jnp.dtype(runner.dtype).name,
                       kv_cache_dtype=llm.kv_cache_dtype, build_s=build_s)
            try:
                llm.generate(prompts(B), warm, use_tqdm=False)
                compiles = llm.num_compilations()
                steps, lens = [], {}
                t0 = time.perf_counter()
                for p in prompts(B):
                    llm.add_request(p, params)
                while llm.has_unfinished_requests():
                    steps.append(timed_step(llm))
                    lens.update((o.request_id, len(o.outputs[0].token_ids))
                                for o in steps[-1].outputs if o.finished)
                wall = time.perf_counter() - t0
                decode = [s for s in steps if s.decode] or steps
                row.update(
                    steps=len(steps), decode_steps=sum(s.decode for s in steps), wall_s=wall,
                    tokens_per_s=B * N / wall,
                    decode_step_ms=1e3 * statistics.mean(s.wall_s for s in decode),
                    decode_device_ms=1e3 * statistics.mean(s.device_s for s in decode),
                    decode_host_ms=1e3 * statistics.mean(s.host_s for s in decode),
                    host_share=statistics.median(s.host_share for s in decode),
                    host_share_all=sum(s.host_s for s in steps) / sum(s.wall_s for s in steps),
                    recompiles=llm.num_compilations() - compiles,
                    ok=len(lens) == B and all(n == N for n in lens.values()))
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(fmt_e2e_row(row), flush=True)
            last_row_s = time.perf_counter() - t_row
        llm.close()
    return rows


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _cell(row, name, key, spec):
    if f"{name}_error" in row:
        return "error"
    return format(row[f"{name}_{key}"], spec) if f"{name}_{key}" in row else "-"


def fmt_decode_row(row) -> str:
    cells = [str(row["batch"]), str(row["context"]), str(row["group"])]
    for name in ("ours", "ragged", "peer"):
        cells += [_cell(row, name, "ms", ".4f"),
                  f"{_cell(row, name, 'min_ms', '.4f')}–{_cell(row, name, 'max_ms', '.4f')}",
                  _cell(row, name, "gbps", ".0f"), _cell(row, name, "frac_copy", ".2f")]
    return "| " + " | ".join(cells) + " |"


def fmt_quant_row(row) -> str:
    """| batch | context | GQA | kv dtype | ms | spread | GB/s | frac | bytes vs bf16 | bf16 ms |
    speedup | target |"""
    if "target" in row:
        target = f"≥ {row['target']}× " + ("pass" if row["target_met"] else "**fail**")
    else:
        target = "-"
    speedup = row.get("speedup_vs_bf16")
    cells = [str(row["batch"]), str(row["context"]), str(row["group"]), row["kv_cache_dtype"],
             _cell(row, "ours", "ms", ".4f"),
             f"{_cell(row, 'ours', 'min_ms', '.4f')}–{_cell(row, 'ours', 'max_ms', '.4f')}",
             _cell(row, "ours", "gbps", ".0f"), _cell(row, "ours", "frac_copy", ".2f"),
             f"{row['kv_bytes'] / row['bf16_kv_bytes']:.3f}", f"{row['bf16_ms']:.4f}",
             "error" if speedup is None else f"×{speedup:.2f}", target]
    return "| " + " | ".join(cells) + " |"


def fmt_sparse_row(row) -> str:
    """| batch | context | budget | pages read | MB read (kernel / step) | of dense | dense ms |
    kernel ms | GB/s | speed-up | step ms | GB/s | speed-up | max err | ok |"""
    head = [str(row["batch"]), str(row["context"]), str(row.get("budget_tokens", "-"))]
    if "dense_error" in row or "error" in row:
        return "| " + " | ".join(head + [f"error: {row.get('error', row.get('dense_error'))}"]
                                 + [""] * 12) + " |"
    cells = head + [str(row["pages_read"]),
                    f"{row['kernel_bytes'] / 1e6:.1f} / {row['quest_bytes'] / 1e6:.1f}",
                    f"{row['quest_bytes'] / row['dense_bytes']:.3f}", f"{row['dense_ms']:.4f}"]
    for name in ("kernel", "quest"):
        cells += [f"{row[f'{name}_ms']:.4f}", f"{row[f'{name}_gbps']:.0f}",
                  f"×{row[f'{name}_speedup']:.2f}"]
    return "| " + " | ".join(cells + [f"{row['max_err']:.2e}", str(row["ok"])]) + " |"


def fmt_kept_row(row) -> str:
    """| batch | context | pages kept | MB read (kept / dense) | kept ms | spread | GB/s | frac |
    dense ms | spread | GB/s | speed-up | max err | ok |"""
    head = [str(row["batch"]), str(row["context"])]
    if "error" in row:
        return "| " + " | ".join(head + [f"error: {row['error']}"] + [""] * 11) + " |"
    cells = head + [f"{row['kept_pages']} / {row['logical_pages']}",
                    f"{row['kept_bytes'] / 1e6:.1f} / {row['dense_bytes'] / 1e6:.1f}"]
    for name in ("kept", "dense"):
        cells += [f"{row[f'{name}_ms']:.4f}",
                  f"{row[f'{name}_min_ms']:.4f}–{row[f'{name}_max_ms']:.4f}",
                  f"{row[f'{name}_gbps']:.0f}"]
        if name == "kept":
            cells.append(f"{row['kept_frac_copy']:.2f}")
    return "| " + " | ".join(cells + [f"×{row['speedup']:.2f}", f"{row['max_err']:.2e}",
                                      str(row["ok"])]) + " |"


def fmt_e2e_row(row) -> str:
    """| batch | prompt | output | steps (decode) | tokens/s | decode step ms | device ms |
    host ms | host share | host share, all steps | attention | recompiles | ok |"""
    head = [str(row["batch"]), str(row["prompt_tokens"]), str(row["output_tokens"])]
    if "error" in row:
        return "| " + " | ".join(head + [f"error: {row['error']}"] + [""] * 9) + " |"
    cells = head + [f"{row['steps']} ({row['decode_steps']})", f"{row['tokens_per_s']:.0f}",
                    f"{row['decode_step_ms']:.3f}", f"{row['decode_device_ms']:.3f}",
                    f"{row['decode_host_ms']:.3f}", f"{row['host_share']:.2f}",
                    f"{row['host_share_all']:.2f}", row["attention_impl"], str(row["recompiles"]),
                    str(row["ok"])]
    return "| " + " | ".join(cells) + " |"


def quant_target_summary(rows) -> list[str]:
    """One line per dtype with a target: at how many batches of the target context it is met."""
    lines = []
    for kv, target in QUANT_TARGETS.items():
        judged = [r for r in rows if r["kv_cache_dtype"] == kv and "target" in r]
        if not judged:
            continue
        met = [r for r in judged if r["target_met"]]
        speedups = [r["speedup_vs_bf16"] for r in judged]
        verdict = "pass" if len(met) == len(judged) else "**fail**"
        failing = ", ".join(str(r["batch"]) for r in judged if not r["target_met"]) or "none"
        lines.append(f"* {kv} ≥ {target}× at context {judged[0]['context']}: {verdict} — met at "
                     f"{len(met)}/{len(judged)} batches (speedup ×{min(speedups):.2f}–"
                     f"×{max(speedups):.2f}; failing batches: {failing})")
    return lines


def markdown(report) -> str:
    lines = [f"# jaxkv GPU check — {report['device']}, jax {report['jax']}", "",
             f"Device-to-device copy bandwidth: **{report['copy_gbps']:.0f} GB/s**; "
             f"run took {report['elapsed_s']:.0f} s.", "", "## (a) correctness vs reference", "",
             "| kernel | variant | dtype | max abs err | ok |", "|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['variant']} | {r['dtype']} | {r['max_err']:.2e} | {r['ok']} |"
              for rows in report["correctness"].values() for r in rows]
    lines += ["", f"## (b) decode, bf16, head_dim {report['head_dim']} (ms per call: median, "
              "min–max; GB/s = KV bytes / time; frac = of copy bandwidth; ragged = the ragged "
              "kernel on the same decode batch; peer = jax ops.gpu.paged_attention)", "",
              "| batch | context | GQA | ours ms | spread | GB/s | frac | ragged ms | spread "
              "| GB/s | frac | peer ms | spread | GB/s | frac |",
              "|" + "---|" * 15]
    lines += [fmt_decode_row(r) for r in report["decode"] if "kv_cache_dtype" not in r]
    quant = [r for r in report["decode"] if "kv_cache_dtype" in r]
    lines += ["", "## (b2) decode, quantized pools (our decode kernel; same batches and q as the "
              "bf16 rows; GB/s = bytes the kernel reads / time: codes + scales + zero points "
              "(fp8/int8: bf16 per-token scales; KIVI int4/int2: keys per channel, scale/zero "
              "[blocks, 1, Hkv, D] bf16, values per token in groups of 32, scale/zero "
              "[blocks, bs, Hkv, D/32] bf16, + int32 res_slot per page + the residual's null "
              "slot); bytes = of the bf16 row's; speedup = bf16 ms / ms; targets at context "
              f"{report.get('target_context', '-')})", "",
              "| batch | context | GQA | kv dtype | ms | spread | GB/s | frac | bytes vs bf16 "
              "| bf16 ms | speedup | target |", "|" + "---|" * 12]
    lines += [fmt_quant_row(r) for r in quant]
    summary = quant_target_summary(quant)
    if summary:
        lines += [""] + summary
    lines += ["", "## (b3) Quest sparse decode (bf16, GQA 4; budget = tokens attended per sequence "
              "and kv head, sinks and recent window included; MB read = the selected pages' K+V "
              "for the kernel / + the f32 key bounds of every page for the whole step; of dense "
              "= step bytes / dense bytes; kernel = sparse kernel with the selection given; "
              "step = page scores + top pages + kernel; speed-up = dense decode ms / ms; max err "
              "= kernel vs sparse_decode_reference)", "",
              "| batch | context | budget | pages read | MB read | of dense | dense ms | kernel ms "
              "| GB/s | speed-up | step ms | GB/s | speed-up | max err | ok |", "|" + "---|" * 15]
    lines += [fmt_sparse_row(r) for r in report.get("sparse", [])]
    lines += ["", "## (b4) kept-blocks decode (bf16, GQA 4; tables keeping 25% of each "
              "sequence's blocks, the rest null; kept = the split-K decode kernel's kept walk, "
              "dense = the same kernel walking every logical tile of the same table; MB read = "
              "kept pages' K+V / every logical position's K+V; GB/s over those bytes; frac = of "
              "copy bandwidth; speed-up = dense ms / kept ms; max err = kept vs dense output)",
              "", "| batch | context | pages kept | MB read | kept ms | spread | GB/s | frac "
              "| dense ms | spread | GB/s | speed-up | max err | ok |", "|" + "---|" * 14]
    lines += [fmt_kept_row(r) for r in report.get("kept", [])]
    lines += ["", "## (c) prefill (one causal prompt)", "",
              "| kernel | tokens | ms | min–max | TFLOP/s |", "|---|---|---|---|---|"]
    for r in report["prefill"]:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['tokens']} | error: {r['error']} | | |")
        else:
            lines.append(f"| {r['kernel']} | {r['tokens']} | {r['ms']:.3f} | "
                         f"{r['min_ms']:.3f}–{r['max_ms']:.3f} | {r['tflops']:.1f} |")
    lines += ["", "## (e) host KV offload (16-token all-layer block units; targets on H200: "
              ">= 40 GB/s D2H, >= 45 GB/s H2D)", "",
              "| path | blocks | MiB per block | D2H GB/s | H2D GB/s |", "|---|---|---|---|---|"]
    for r in report.get("offload", []):
        if "error" in r:
            lines.append(f"| {r['path']} | | | {r['error']} | |")
        else:
            lines.append(f"| {r['path']} | {r['blocks']} | {r['block_bytes'] / 2**20:.2f} | "
                         f"{r['d2h_gbps']:.1f} | {r['h2d_gbps']:.1f} |")
    lines += ["", "## (d) decode config sweep", "",
              "| batch | context | config | splits | ms | GB/s | frac |", "|" + "---|" * 7]
    for r in report["sweep"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['config']} | {r['num_splits']} "
                         f"| error: {r['error']} | | |")
        else:
            lines.append(f"| {r['batch']} | {r['context']} | {r['config']} | {r['num_splits']} "
                         f"| {r['ms']:.4f} | {r['gbps']:.0f} | {r['frac_copy']:.2f} |")
    e2e = report.get("e2e", [])
    model = f"{e2e[0]['model']}, {e2e[0]['dtype']} (KV {e2e[0]['kv_cache_dtype']}), " \
        f"built and loaded in {e2e[0]['build_s']:.0f} s" if e2e else "not run"
    lines += ["", f"## (f) end to end: jaxkv.LLM on a random Llama ({model}; greedy, "
              "ignore_eos, random prompt ids; after a warm-up generate of the same batch, so "
              "compiles are excluded; tokens/s = output tokens / wall time of the whole run, "
              "prefill included; decode step ms = mean wall of the decode-only steps, device = "
              "the jitted step from dispatch to tokens on the host, host = the rest; host share "
              "= host / wall: median over decode steps, and over all steps' sums)", "",
              "| batch | prompt | output | steps (decode) | tokens/s | decode step ms | device ms "
              "| host ms | host share | host share, all steps | attention | recompiles | ok |",
              "|" + "---|" * 13]
    lines += [fmt_e2e_row(r) for r in e2e]
    if report["errors"]:
        lines += ["", "## errors", ""] + [f"* {e}" for e in report["errors"]]
    return "\n".join(lines) + "\n"


def write(report, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(markdown(report))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes in Pallas interpret mode on CPU (CI smoke test)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"),
                        help="output folder (default $OUT, else ./out)")
    args = parser.parse_args(argv)
    settings = DRY if args.dry_run else REAL
    clock = Clock()
    device = jax.devices()[0]
    report = dict(device=f"{device.platform} {device.device_kind}", jax=jax.__version__,
                  python=platform.python_version(), dry_run=args.dry_run, copy_gbps=0.0,
                  head_dim=settings.head_dim, target_context=settings.target_context,
                  correctness=dict(ours=[], peer=[]), decode=[],
                  prefill=[], sparse=[], kept=[], sweep=[], offload=[], e2e=[], errors=[],
                  elapsed_s=0.0)

    def section(key, fn):
        try:
            report[key] = fn()
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            traceback.print_exc()
            report["errors"].append(f"{key}: {type(e).__name__}: {str(e)[:300]}")
        report["elapsed_s"] = clock.elapsed()
        write(report, args.out)

    try:
        peer = make_peer(settings)
    except Exception as e:  # noqa: BLE001 - the peer is optional
        peer = None
        report["errors"].append(f"peer import: {type(e).__name__}: {e}")
    section("copy_gbps", lambda: copy_bandwidth(settings))
    print(f"copy bandwidth {report['copy_gbps']:.0f} GB/s", flush=True)
    section("correctness", lambda: check_correctness(settings, peer, report["errors"]))
    copy_gbps = report["copy_gbps"] or 1.0
    section("decode", lambda: bench_decode(settings, clock, peer, copy_gbps))
    section("kept", lambda: bench_kept(settings, clock, copy_gbps))
    section("prefill", lambda: bench_prefill(settings))
    section("offload", lambda: bench_offload(settings))
    section("sparse", lambda: bench_sparse(settings, clock, copy_gbps))
    section("sweep", lambda: sweep_decode(settings, clock, copy_gbps))
    section("e2e", lambda: bench_e2e(settings, clock))
    print(markdown(report))
    ok = all(r["ok"] for r in report["correctness"]["ours"]) and not report["errors"] \
        and all(r.get("ok", False) for r in report["sparse"] + report["kept"] + report["e2e"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
