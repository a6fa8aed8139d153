"""GPU check of jaxkv in one process: the Pallas attention kernels against the reference at real
sizes, the decode bandwidth and prefill speed table, and the engine end to end.

Run from the repository root (sections (a)-(e) need only jax + numpy; (f) jaxkv's engine imports:
safetensors, tokenizers, jinja2, tqdm, which the GPU image holds; ``gguf``, which it lacks, is
imported only to read a GGUF file, and (f) reads none):

    PYTHONPATH=. python3 bench/gpu_check.py                  # < 8 min: $OUT/gpu_check.{md,json}
    PYTHONPATH=. python3 bench/gpu_check.py --quick          # < 3 min
    PYTHONPATH=. python3 bench/gpu_check.py --dry-run        # CPU: tiny sizes, interpret mode
    JAX_PLATFORMS=cpu PYTHONPATH=. VENV/bin/python bench/gpu_check.py --prepare DIR   # here
    PYTHONPATH=. python3 bench/gpu_check.py --artifacts DIR  # on the device: load, not compile

Compiles run ahead: a second pass over (a)-(d), in a thread, with shapes only (``Run``'s
abstract pass, the one --prepare makes), lowers every executable the run will ask for and hands
it to a pool of cpu_count - 2 threads that compile it (or load it, below); the run waits only
for the executable it needs next. (f) starts after every such executable is got, so that its
host timings do not share the CPU with compiles.

Modes:
  (default) every section, under the time guards below.
  --quick: 62 executables instead of 381, one LLM instead of four. (a) keeps every kernel,
    format and option at real sizes but not every product (``QUICK_POOLS``: split-K at auto
    splits only, the same kernel as splits=1 on a larger grid; fp32 plain; the sparse kernel
    on bf16, int8 and a written int4 pool, the hardest of its readers): 49 executables of 84;
    (b) at 32k context, batches 8 and 128, GQA 4, with (b2)'s fp8 and int4 rows (the headline
    bandwidths and two targets: 10 of 88); (c) the ragged kernel and cuDNN (2 of 5); one (f)
    row (SmolLM2's geometry, bf16 KV, batch 64); no (b3), (b4), (b5), (d), (e).
  --dry-run: tiny sizes in Pallas interpret mode on the CPU, no time guards. Every executable is
    also archived (OUT/artifacts/cpu.zip), and the archived copy loaded back and used, so the
    archive path runs too; ``--quick`` selects as above; ``--prepare``/``--artifacts`` work
    with this CPU as the target.
  --prepare DIR: no device and nothing run: every executable of (a)-(d) of the full run (the
    quick run's are among them) is compiled here for ``--target`` (tests/gpu_targets/NAME.txtpb,
    default h100_sxm) and archived in DIR/NAME.zip (bench/lib/gpu_artifacts.py). Needs the
    device's jax, jaxlib and jax CUDA plugin versions, with ptxas (bench/README.md).
  --artifacts PATH (repeatable; a zip, or a folder of them): an executable an archive holds is
    loaded instead of compiled, where the archive's manifest matches this process (jax, jaxlib
    and plugin versions, XLA_FLAGS, the kernels' sources, GPU generation); else everything is
    compiled and the report says why. The first loaded executable of each section is compiled
    too, to time both and compare their outputs.
  A device run archives what it compiled in OUT/artifacts/<device kind>.zip (up to 15 MiB) for
  a rerun to load. The JSON's ``executables`` has each one's section, whether it was got ahead,
  its lower, compile or load seconds, and how long the run waited for it; the report sums them.

Sections, in the order they run:
  (a) every kernel (ragged, split-K decode at 1 and auto splits, Quest's sparse decode) vs the
      pure-jnp reference (jaxkv.attention.reference, jaxkv.attention.quest) on 8 sequences of
      1-1000 query tokens over 1-32768 kv positions (head_dim 128, 8 kv heads, GQA 4), on every
      pool format: bf16 and fp32 (plain, window 1024 + 4 sinks, soft-cap 30), fp8_e4m3, int8,
      KIVI int4/int2 fully sealed (``quantize_pages``) and KIVI pools written through
      ``cache.write`` whose sequences end in unsealed blocks (the residual path); the sparse
      kernel on Quest's pages (budget 512 tokens) with and without soft-cap;
  (b) decode: contexts 32k, 8k, 512 (longest first: a time guard drops the short ones) x GQA 4, 8
      x batches 1-128, bf16, head_dim 128, 8 kv heads; GB/s = KV bytes read / time, as a
      fraction of the device-to-device copy bandwidth measured first in the same run; our
      split-K kernel, the ragged kernel on the same decode batch, and
      jax.experimental.pallas.ops.gpu.paged_attention;
  (b2) quantized decode, after each context's bf16 rows: fp8_e4m3, int8 (bf16 per-token scales),
      KIVI int4/int2 pools at 32k, the bf16 rows' batches and q: ms, GB/s over the bytes the
      kernel reads (codes + scales + zero points + int32 res_slot per page + the residual's null
      slot), the speedup over the bf16 row, issue #6's targets (>= 1.7x fp8/int8, >= 2.5x int4);
  (c) prefill: one 8k-token causal prompt through the ragged kernel (3 configs) vs dense flash
      attention (pallas ops.gpu.attention.mha with K/V repeated to every head, cuDNN's
      jax.nn.dot_product_attention); TFLOP/s = 4 * Hq * D * T * (T + 1) / 2 causal flops / time;
  (f) end to end (issue 16): ``jaxkv.LLM`` on random-weight models written on the machine as HF
      directories (bench/lib/random_model.py, in a background thread from the start of the
      run): SmolLM2-135M's geometry (30 layers, hidden 576, 9 q / 3 kv heads of 64, tied
      vocab 49152) and a Llama-3-8B-shaped model with 4 of its 32 layers (hidden 4096, 32 q / 8
      kv heads of 128, intermediate 14336, untied vocab 128256: 1.9B parameters, 3.9 GB to
      write and load where 32 layers would be 16 GB), each with bf16 and fp8_e4m3 KV; 128
      random prompt ids and 128 greedy tokens a request (ignore_eos) after a warm-up generate
      of the same batch (compiles excluded; a recompile in the timed run is counted): output
      tokens/s, the decode step's ms, and the host share (wall - device) / wall of each
      ``llm.step()`` (bench/lib/step_timing.py). A row whose requests do not get exactly 128
      tokens fails the run;
  (b3) Quest sparse decode vs the dense split-K kernel at 8k and 32k, bf16, GQA 4, budgets 512 and
      2048 tokens: bytes read, GB/s, speed-up of the kernel alone and of the whole step (scores
      + top pages + kernel), the kernel vs the sparse reference;
  (b4) kept-blocks decode (issue 13): tables keeping 25% of each sequence's blocks, the kept walk
      vs the dense walk of the same table (a window covering the whole context): bytes, ms,
      GB/s, speed-up, and the two outputs' difference;
  (b5) absorbed MLA decode (issue 53): DeepSeek-V3's latent (512 + 64, bf16, 128 query heads
      sharing it) at 32k and 4k x batches 1, 32, 128, the MLA kernel at its default head tile (16
      heads a program) and at 64: ms, GB/s over the latent bytes (batch x context x 576 x 2, read
      once), fraction of copy; the same latent as fp8 e4m3 codes with a bf16 scale per token
      (``kv_cache_dtype="fp8"``: 578 bytes a token, dequantized in the kernel); at batch 1
      each kernel vs ``mla_attention_reference`` over its own pool;
  (g) quantized weights (issue 51): the Pallas ``quantized_matmul`` over square Q8_0 and Q4_1
      weights (GGUF's blocks), Q4_K and Q6_K as jaxkv keeps them (Q4_1 codes, an f32 scale and
      minimum per 32; Q8_0 codes, an f32 scale per 16), MXFP4 (gpt-oss's experts: e2m1 codes,
      an E8M0 byte per 32), int4 in groups of 128 and fp8 per channel (made at load) of 4096
      and 8192 (Llama-3-8B's and -70B's q/o_proj) at 1, 8 and 64 rows,
      bf16 activations: ms, GB/s over the stored bytes, fraction of copy; XLA's bf16 product
      with the dequantized weight beside it; the output vs float32 dequantize-then-dot;
  (e) host KV offload (issue 14): HostKVPool D2H/H2D GB/s of 2 MiB all-layer blocks (8B-class),
      staged through pinned_host and not, batches of 1-512; raw device_put vs a jitted copy to
      ``pinned_host`` (targets on H200: >= 40 GB/s D2H, >= 45 GB/s H2D);
  (d) a tuning sweep of the decode kernel's configs, with the time left.
Every timing runs the op ``inner`` times inside one jitted loop (each call feeds its output into
the next q, so nothing is hoisted), ``reps`` times: median and min/max per call. Every section and
row is guarded: a failure is recorded, the run goes on. Exit status 0: every kernel matched the
reference, every sparse / kept / MLA / end-to-end row is ok and no section failed.

Time guards (seconds since the process started; full | quick): no bf16 decode row starts after
200 | 110, no quantized one after 230 | 120; (f) starts before 260 | 135, no end-to-end row after
400 | 135, nor one the previous row's time (its LLM's build included) would carry past 430 |
170; then sparse rows until 420, kept-blocks rows until 430, MLA rows until 431, weight rows
until 432, offload before 430, sweep rows until 440 (full only). The report counts the rows
each guard dropped.

Time estimate (no device has run this yet: from the structure, and compile times measured
deviceless here). The full run has 435 executables: (a) 84 (41 kernel checks, 35 references, 8
Quest selections), (b)+(b2) 88 timing loops, (c) 5, (b3) 47, (b4) 16, (b5) 26, (g) 132 (7
formats x 2 sizes x 3 batches: the kernel's check and timing loop and the reference, + 6 bf16
timing loops), (d) 36, the copy 1 (the estimate below predates (g) and (b5)). Their
deviceless compile for an H100 (jax 0.11.2) took 1348 s summed, 4.9 s each, on 2 shared cores
(load ~6); one alone, uncontended: 1.4 s (jax 0.10.2) to 2.4 s (0.11.2) for a 32k split-K timing
loop, 0.2-0.5 s to lower it. At ~2.5 s a compile and ~0.3 s a lowering on the device, one after
another the full run's would take ~13 min, more than the whole run may. Ahead on 14 threads,
the lowering in one thread (~85 s) bounds them: all are got by ~100 s (the CPU dry run: 122
executables, every one got ahead). Run time besides: start-up ~10 s, (a) ~10 s (the references
at 32k), (b) ~15 s, an LLM's build and warm-up compiles ~25 s: (f) 4 LLMs and 6 rows ~150 s,
(b3)-(d) ~40 s. Full: ~300 s (< 8 min; if compiles run slower, the guards end it by ~445 s);
quick: ~30 s ahead, ~35 s of runs, ~35 s of (f): ~100 s (< 3 min; guards by ~170 s). A loaded
executable costs no lowering and ~0.05 s (on the CPU here) instead of its compile: with an
archive, the pass ahead is done within seconds.
"""

from __future__ import annotations

import time

START = time.perf_counter()    # the time guards count from the process start, imports included

import argparse  # noqa: E402 - after START
import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxkv.attention.mla import mla_attention_reference  # noqa: E402
from jaxkv.attention.pallas import (DecodeConfig, RaggedConfig, default_num_splits,  # noqa: E402
                                    paged_decode_attention, ragged_paged_attention)
from jaxkv.attention.pallas.mla_decode import MLADecodeConfig, mla_decode_attention  # noqa: E402
from jaxkv.attention.reference import paged_attention_reference  # noqa: E402
from jaxkv.kvcache.spec import KV_FORMATS, KVCacheSpec  # noqa: E402
from jaxkv.model.quantized import QuantizedWeight, dequantize  # noqa: E402
from jaxkv.model.quantized_matmul import quantized_matmul  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, for lib/
from lib import gpu_artifacts as artifacts  # noqa: E402
from lib.gpu_e2e import (LLAMA3_8B_L4, SMOLLM2_135M, E2EModel, build_llm, e2e_row,  # noqa: E402
                         write_models)
from lib.gpu_report import (QUANT_TARGETS, fmt_decode_row, fmt_e2e_row,  # noqa: E402
                            fmt_kept_row, fmt_mla_row, fmt_quant_row, fmt_sparse_row,
                            fmt_weight_row, markdown)

TOL = {"float32": dict(atol=2e-4, rtol=2e-4), "bfloat16": dict(atol=2e-2, rtol=2e-2)}
KIVI_DTYPES = tuple(name for name, f in KV_FORMATS.items() if f.kivi)   # int4, int2
TARGETS = Path(__file__).resolve().parents[1] / "tests" / "gpu_targets"   # data, not imported


# --------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------


# (a): (pool, option sets, kernels); sparse runs on the option sets it takes (soft-cap)
FLOAT_VARIANTS = ("plain", "window+sinks", "softcap")
EVERY_KERNEL = ("ragged", "decode splits=1", "decode splits=auto", "sparse")
QUANT_KERNELS = ("ragged", "decode splits=auto", "sparse")
QUANT_POOLS = ("fp8_e4m3", "int8", "int4", "int2", "int4 written", "int2 written")
FULL_POOLS = (("bfloat16", FLOAT_VARIANTS, EVERY_KERNEL), ("float32", FLOAT_VARIANTS, EVERY_KERNEL),
              *((pool, ("plain",), QUANT_KERNELS) for pool in QUANT_POOLS))
# quick: split-K at auto splits only, fp32 plain, sparse on bf16 / int8 / a written int4 pool
DENSE_KERNELS = ("ragged", "decode splits=auto")
QUICK_POOLS = (("bfloat16", FLOAT_VARIANTS, QUANT_KERNELS), ("float32", ("plain",), DENSE_KERNELS),
               ("fp8_e4m3", ("plain",), DENSE_KERNELS), ("int8", ("plain",), QUANT_KERNELS),
               ("int4", ("plain",), DENSE_KERNELS), ("int2", ("plain",), DENSE_KERNELS),
               ("int4 written", ("plain",), QUANT_KERNELS))

SECTIONS = ("copy_gbps", "correctness", "decode", "prefill", "e2e", "sparse", "kept", "mla",
            "weights", "offload", "sweep")
PREPARED = ("copy_gbps", "correctness", "decode", "prefill", "sparse", "kept", "mla", "weights",
            "sweep")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Problem sizes, selections and time guards of one run."""

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
    q_lens: tuple[int, ...]  # (a): query tokens and kv lengths of its sequences
    kv_lens: tuple[int, ...]
    window: int              # (a): the window of its window+sinks option set
    sweep_block_kv: tuple[int, ...]
    sweep_launch: tuple[tuple[int, int], ...]     # (num_warps, num_stages)
    e2e_models: tuple[E2EModel, ...]
    pools: tuple = FULL_POOLS                     # (a): (pool, option sets, kernels)
    sections: tuple[str, ...] = SECTIONS
    until: tuple[tuple[str, float], ...] = ()     # time guards; a missing one never stops
    quant_contexts: tuple[int, ...] = ()          # (b2)
    quant_dtypes: tuple[str, ...] = ("fp8_e4m3", "int8", "int4", "int2")
    quant_groups: tuple[int, ...] = (4,)
    target_context: int = 32768   # context at which QUANT_TARGETS are judged
    prefill_configs: tuple = (None, RaggedConfig(block_q=32, block_kv=64, num_warps=8,
                                                 num_stages=2),
                              RaggedConfig(block_q=16, block_kv=128, num_warps=8, num_stages=3))
    prefill_peers: tuple[str, ...] = ("mha", "dpa")
    sparse_contexts: tuple[int, ...] = ()         # (b3)
    sparse_batches: tuple[int, ...] = (8, 32)
    sparse_budgets: tuple[int, ...] = (512, 2048)  # tokens attended per (sequence, kv head)
    sparse_sinks: int = 16        # sink tokens always attended
    sparse_recent: int = 64       # recent tokens always attended (the current one included)
    kept_contexts: tuple[int, ...] = ()           # (b4)
    kept_batches: tuple[int, ...] = (8, 32)
    kept_fraction: float = 0.25
    mla_contexts: tuple[int, ...] = ()            # (b5)
    mla_batches: tuple[int, ...] = (1, 32, 128)
    mla_heads: int = 128                          # query heads sharing each latent
    mla_latent: tuple[int, int] = (512, 64)       # (Lkv, R)
    weight_sizes: tuple[int, ...] = ()            # (g): square [K, K] weights
    weight_batches: tuple[int, ...] = (1, 8, 64)
    weight_formats: tuple[str, ...] = ("Q8_0", "Q4_1", "Q4_K", "Q6_K", "MXFP4", "int4-g128",
                                       "fp8")             # WEIGHT_FORMATS
    offload_layers: int = 32       # (e): the block geometry moved to and from the host
    offload_kv_heads: int = 8
    offload_blocks: tuple[int, ...] = (1, 8, 64, 512)
    e2e_prompt: int = 128          # random prompt token ids per request
    e2e_tokens: int = 128          # output tokens per request (greedy, ignore_eos)
    e2e_warmup_tokens: int = 16    # the warm-up generate's (same batch and prompt length)
    e2e_impl: str | None = None    # attention_impl (None: the engine's default for the backend)

    def until_s(self, guard: str) -> float:
        return dict(self.until).get(guard, math.inf)


FULL_UNTIL = (("decode", 200.0), ("quant", 230.0), ("e2e_start", 260.0), ("e2e", 400.0),
              ("e2e_end", 430.0), ("sparse", 420.0), ("kept", 430.0), ("mla", 431.0),
              ("weights", 432.0), ("offload", 430.0),
              ("sweep", 440.0))
QUICK_UNTIL = (("decode", 110.0), ("quant", 120.0), ("e2e_start", 135.0), ("e2e", 135.0),
               ("e2e_end", 170.0))

FULL = Settings(
    interpret=False, head_dim=128, num_kv_heads=8, block_size=16,
    batches=(1, 8, 32, 128), contexts=(512, 8192, 32768), groups=(4, 8),
    prefill_tokens=8192, copy_bytes=2 << 30, reps=5, target_s=0.02,
    q_lens=(1000, 1, 1, 300, 1, 1, 1024, 1), kv_lens=(1000, 4000, 8191, 2348, 17, 1, 1040, 32768),
    window=1024, sweep_block_kv=(32, 64, 128), sweep_launch=((4, 2), (4, 3), (8, 2)),
    e2e_models=(E2EModel("SmolLM2-135M's geometry", tuple(SMOLLM2_135M.items()),
                         (("auto", (1, 64)), ("fp8_e4m3", (64,)))),
                E2EModel("Llama-3-8B's shape, 4 of its 32 layers", tuple(LLAMA3_8B_L4.items()),
                         (("auto", (1, 32)), ("fp8_e4m3", (32,))))),
    until=FULL_UNTIL, quant_contexts=(32768,), sparse_contexts=(8192, 32768),
    kept_contexts=(8192, 32768), mla_contexts=(4096, 32768), weight_sizes=(4096, 8192))
# head_dim 64: the smallest at which int2 is served (chunks of head_dim / 4 >= 16 channels)
DRY = Settings(
    interpret=True, head_dim=64, num_kv_heads=2, block_size=8,
    batches=(1, 2), contexts=(64,), groups=(4,), prefill_tokens=64, copy_bytes=1 << 20, reps=2,
    target_s=0.0, q_lens=(5, 1, 1), kv_lens=(5, 30, 9), window=7,
    sweep_block_kv=(16,), sweep_launch=((4, 2),),
    # two tiny Llamas: tied (SmolLM2-like) and untied with GQA 4 (8B-like)
    e2e_models=(E2EModel("tiny", tuple(dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             num_key_value_heads=1).items()),
                         (("auto", (1, 4)), ("fp8_e4m3", (4,)))),
                E2EModel("tiny untied", tuple(dict(vocab_size=300, hidden_size=128,
                                                   intermediate_size=256, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=1,
                                                   tie_word_embeddings=False).items()),
                         (("auto", (4,)), ("fp8_e4m3", (4,))))),
    quant_contexts=(64,), target_context=64, sparse_contexts=(64,), sparse_batches=(2,),
    sparse_budgets=(32, 48), sparse_sinks=8, sparse_recent=8, kept_contexts=(64,),
    kept_batches=(2,), mla_contexts=(64,), mla_batches=(1,), mla_heads=4, mla_latent=(32, 16),
    weight_sizes=(64,), weight_batches=(1, 3), offload_layers=2, offload_kv_heads=2, offload_blocks=(1, 8),
    e2e_prompt=16, e2e_tokens=4, e2e_warmup_tokens=2, e2e_impl="pallas")


def quick(s: Settings, *, batches: tuple[int, ...], until) -> Settings:
    """``s`` reduced to the quick run: the longest context at ``batches``, GQA 4, fp8 and int4
    pools, the ragged prefill and cuDNN, one end-to-end row (the first model, bf16 KV, the
    largest batch), QUICK_POOLS in (a); every executable one of ``s``'s."""
    first = s.e2e_models[0]
    model = dataclasses.replace(first, runs=(("auto", (max(first.runs[0][1]),)),))
    return dataclasses.replace(
        s, pools=QUICK_POOLS, sections=("copy_gbps", "correctness", "decode", "prefill", "e2e"),
        contexts=s.contexts[-1:], quant_contexts=s.contexts[-1:], batches=batches, groups=(4,),
        quant_dtypes=("fp8_e4m3", "int4"), prefill_configs=(None,), prefill_peers=("dpa",),
        e2e_models=(model,), until=until)


QUICK = quick(FULL, batches=(8, 128), until=QUICK_UNTIL)
DRY_QUICK = quick(DRY, batches=(2,), until=())


# --------------------------------------------------------------------------------------------
# one run: its executables, clock and errors
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """A pass over the sections: on the device's arrays, or ``abstract`` (shapes only: every
    executable is handed to ``exes.ahead`` and nothing runs; --prepare, and the pass that
    compiles ahead of a device run)."""

    settings: Settings
    exes: artifacts.Executables
    abstract: bool = False
    section: str = ""
    copy_gbps: float = 1.0
    errors: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)   # rows a guard dropped

    @staticmethod
    def elapsed() -> float:
        return time.perf_counter() - START

    def late(self, guard: str, rows: int = 1, ahead_s: float = 0.0) -> bool:
        """``ahead_s`` from now is past the ``guard`` time (never in an abstract pass); counts the
        ``rows`` it drops."""
        if self.abstract or self.elapsed() + ahead_s <= self.settings.until_s(guard):
            return False
        self.skipped[guard] = self.skipped.get(guard, 0) + rows
        return True

    def data(self, fn, *args):
        """fn(*args): arrays of a row's inputs (their shapes in an abstract pass)."""
        return jax.eval_shape(fn, *args) if self.abstract else fn(*args)

    def executable(self, name: str, fn, args):
        """The executable of jax.jit(fn) on ``args`` (None in an abstract pass, which starts
        getting it)."""
        if self.abstract:
            self.exes.ahead(name, fn, args, self.section)
            return None
        return self.exes.get(name, fn, args, self.section)

    def call(self, label: str, fn, *args):
        """jax.jit(fn)(*args) through the run's executables (the outputs' shapes in an abstract
        pass)."""
        exe = self.executable(f"{label}: {artifacts.describe(fn)}", fn, args)
        return jax.eval_shape(fn, *args) if exe is None else exe(*args)

    def time_op(self, label: str, fn, args, *, est_s: float):
        """Per-call seconds of fn(*args): (median, min, max) over ``reps`` repetitions of a
        jitted loop of ``inner`` calls; None in an abstract pass."""
        s = self.settings
        inner = max(1, min(200, int(s.target_s / max(est_s, 1e-6))))
        exe = self.executable(f"time x{inner} {label}: {artifacts.describe(fn)}",
                              looped(fn, inner), args)
        if exe is None:
            return None
        jax.block_until_ready(exe(*args))                          # warm up
        times = []
        for _ in range(s.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*args))
            times.append((time.perf_counter() - t0) / inner)
        return float(np.median(times)), float(min(times)), float(max(times))

    def timed(self, row: dict, name: str | None, label: str, fn, args,
              nbytes: int | None = None, est_s: float | None = None) -> None:
        """``time_op`` into ``row``: ``{name}_ms``, min/max, and with ``nbytes`` GB/s and the
        fraction of the copy bandwidth (``ms``, ``gbps``, ... without a name); an error into
        ``{name}_error``. ``est_s`` (default: ``nbytes`` at 3 TB/s) sets the loop's length."""
        p = f"{name}_" if name else ""
        try:
            t = self.time_op(label, fn, args, est_s=nbytes / 3e12 + 5e-6 if est_s is None
                             else est_s)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row[f"{p}error"] = f"{type(e).__name__}: {str(e)[:200]}"
            return
        if t is None:
            return
        med, lo, hi = t
        row.update({f"{p}ms": med * 1e3, f"{p}min_ms": lo * 1e3, f"{p}max_ms": hi * 1e3})
        if nbytes is not None:
            row.update({f"{p}gbps": nbytes / med / 1e9,
                        f"{p}frac_copy": nbytes / med / 1e9 / self.copy_gbps})


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


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def page_tables(kv_lens, bs: int):
    """int32 block tables (numpy) over a random permutation of page ids 1.., and the lengths."""
    blocks = [-(-n // bs) for n in kv_lens]
    perm = np.random.default_rng(0).permutation(np.arange(1, 1 + sum(blocks))).astype(np.int32)
    tables = np.zeros((len(kv_lens), max(blocks)), np.int32)
    used = 0
    for s, nb in enumerate(blocks):
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    return tables, np.asarray(kv_lens, np.int32)


def random_pools(seed: int, num_blocks: int, s: Settings, dtype):
    """(K, V) pools [num_blocks, block_size, Hkv, D] of normal values."""
    kk, kv = jax.random.split(jax.random.key(seed))
    shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    return jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)


def make_paged(run: Run, seed: int, kv_lens, dtype=jnp.bfloat16):
    """(K, V, tables, lens): pools of every sequence's blocks (shapes in an abstract pass)."""
    tables, lens = page_tables(kv_lens, run.settings.block_size)
    k, v = run.data(functools.partial(random_pools, seed, 1 + int(np.sum(tables > 0)),
                                      run.settings, dtype))
    return k, v, jnp.asarray(tables), jnp.asarray(lens)


def normal(run: Run, seed: int, shape, dtype=jnp.bfloat16):
    return run.data(lambda: jax.random.normal(jax.random.key(seed), shape, dtype))


def max_err(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))


def is_close(got, want, dtype_name):
    return bool(np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                            **TOL[dtype_name]))


@functools.partial(jax.jit, static_argnames=("kv_cache_dtype",))
def quantize_kv(k, v, kv_cache_dtype: str):
    """(K, V) ``QuantizedPages`` of float pools, every block sealed: fp8/int8 per token; KIVI
    int4/int2 keys per channel (over a block's tokens), values per token (groups of 32)."""
    from jaxkv.kvcache.pools import quantize_pages

    kivi = kv_cache_dtype in KIVI_DTYPES
    return (quantize_pages(k, kv_cache_dtype, axis="channel" if kivi else "token"),
            quantize_pages(v, kv_cache_dtype, axis="token"))


def written_kivi_pools(k, v, *, tables: np.ndarray, lens: np.ndarray, kv_cache_dtype: str):
    """KIVI (K, V) pools built the serving way: ``init_cache`` + one ``cache.write`` of every
    token of every sequence (the values of the float pools ``k``, ``v`` at the same slots).
    Blocks filled to the end are sealed (codes); the tail block of a sequence whose length is
    not a multiple of block_size stays unsealed, in the full-precision residual."""
    from jaxkv.kvcache import pages as kvcache

    num_blocks, bs, hkv, d = k.shape
    pos = [np.arange(n) for n in lens]
    blk = jnp.asarray(np.concatenate([tables[s, p // bs] for s, p in enumerate(pos)]), jnp.int32)
    off = jnp.asarray(np.concatenate([p % bs for p in pos]), jnp.int32)
    c = kvcache.init_cache(KVCacheSpec(num_layers=1, num_blocks=num_blocks, block_size=bs,
                                       num_kv_heads=hkv, head_dim=d, dtype=jnp.dtype(k.dtype).name,
                                       kv_cache_dtype=kv_cache_dtype, num_residual_slots=len(lens)))
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


def quantized_pools(k, v, kv_cache_dtype: str):
    """``quantize_kv``'s pools with ``wide_offsets``."""
    return tuple(wide_offsets(p) for p in quantize_kv(k, v, kv_cache_dtype))


def nbytes(a) -> int:
    """Bytes of an array or a ShapeDtypeStruct."""
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def read_bytes(pool, pages_read: int) -> int:
    """Bytes the kernels read from one pool for ``pages_read`` pages: a float pool's pages; a
    ``QuantizedPages``' codes + scales + zero points (per-page slices of every [num_blocks, ...]
    array: fp8/int8 per-token scales; KIVI per-channel [N, 1, Hkv, D] or per-token
    [N, bs, Hkv, D / G] bf16 scale and zero, the int32 res_slot) + its residual pool once (for a
    ``quantize_pages`` pool only the null slot, which every sealed page reads, and one empty
    slot)."""
    if not hasattr(pool, "data"):
        return nbytes(pool) // pool.shape[0] * pages_read
    per_page = sum(nbytes(a) for a in (pool.data, pool.scale, pool.zero, pool.res_slot)
                   if a is not None) // pool.data.shape[0]
    return per_page * pages_read + (0 if pool.residual is None else nbytes(pool.residual))


def is_kivi(pool) -> bool:
    return hasattr(pool, "format") and pool.format.kivi


def quest_pages(q, k, tables, lens, *, budget: int, num_sinks: int, recent: int):
    """Quest's (pages, count): bounds from the pool (``key_bounds``; a KIVI pool's statistics)."""
    from jaxkv.attention.quest import key_bounds, quest_select

    bounds = None if is_kivi(k) else key_bounds(k, tables, lens)
    return quest_select(q, k, tables, lens, budget=budget, bounds=bounds, num_sinks=num_sinks,
                        recent=recent)


def to_hnd(pool):
    """[P, bs, Hkv, D] (ours, NHD) -> [Hkv, P, bs, D] (the peer's HND layout)."""
    return jnp.transpose(pool, (2, 0, 1, 3))


def ragged_decode(q, k, v, tables, lens, *, interpret):
    """The ragged kernel on a decode batch: one query token per sequence."""
    qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return ragged_paged_attention(q, k, v, tables, lens, qsl, interpret=interpret)


def peer_paged_attention(q, k_hnd, v_hnd, tables, lens, *, interpret):
    """jax.experimental.pallas.ops.gpu.paged_attention on our decode batch (q scaled by
    1/sqrt(D): it applies no scale)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    pages = tables.shape[1]
    k_splits = math.gcd(16, pages)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return jpa.paged_attention((q * scale).astype(q.dtype), k_hnd, v_hnd, tables, lens,
                               k_splits=k_splits,
                               pages_per_compute_block=math.gcd(8, pages // k_splits),
                               interpret=interpret)


# --------------------------------------------------------------------------------------------
# (a) correctness
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Inputs:
    """One pool's arguments: the ragged step's (q, qsl over every token, padding after n) and
    the decode batch's (qd: each sequence's first query; Quest's pages of it)."""

    q: object
    qd: object
    k: object
    v: object
    tables: object
    lens: object
    qsl: object
    qsl_d: object
    n: int
    selection: tuple | None = None


def variant_options(variant: str, s: Settings) -> dict:
    return {"plain": {}, "window+sinks": dict(sliding_window=s.window, num_sinks=4),
            "softcap": dict(soft_cap=30.0)}[variant]


def pool_inputs(run: Run, pool: str, base, tables: np.ndarray, lens: np.ndarray) -> Inputs:
    """The arguments of ``pool``: bfloat16 (``base``), float32, fp8/int8/int4/int2 quantized
    from ``base``, or "int4 written"/"int2 written" (``written_kivi_pools``: the sequences whose
    length is not a multiple of block_size end in an unsealed block, checked)."""
    s = run.settings
    fmt = pool.split()[0]
    if pool == "float32":
        k, v = run.data(functools.partial(random_pools, 1, base[0].shape[0], s, jnp.float32))
    elif pool == "bfloat16":
        k, v = base
    elif pool.endswith("written"):
        k, v = run.data(functools.partial(written_kivi_pools, tables=tables, lens=lens,
                                          kv_cache_dtype=fmt), *base)
        tails = int(np.sum(lens % s.block_size != 0))
        if not run.abstract and int(jnp.sum(k.res_slot > 0)) != tails:
            raise AssertionError(f"{int(jnp.sum(k.res_slot > 0))} unsealed blocks, expected "
                                 f"{tails}")
    else:
        k, v = run.data(functools.partial(quantized_pools, kv_cache_dtype=fmt), *base)
    q = normal(run, 2, (sum(s.q_lens) + 5, 4 * s.num_kv_heads, s.head_dim),
               jnp.float32 if pool == "float32" else jnp.bfloat16)
    S = len(lens)
    qd = run.data(lambda q: q[:S], q)
    return Inputs(q, qd, k, v, jnp.asarray(tables), jnp.asarray(lens),
                  jnp.asarray(np.concatenate([[0], np.cumsum(s.q_lens)]), jnp.int32),
                  jnp.arange(S + 1, dtype=jnp.int32), sum(s.q_lens))


def kernel_calls(kernel: str, opts: dict, x: Inputs, interpret: bool):
    """(kernel fn, its args, reference fn, its args) of one (a) row."""
    from jaxkv.attention.pallas import sparse_paged_decode_attention
    from jaxkv.attention.quest import sparse_decode_reference

    decode = (x.qd, x.k, x.v, x.tables, x.lens)
    if kernel == "ragged":
        args = (x.q, x.k, x.v, x.tables, x.lens, x.qsl)
        return (functools.partial(ragged_paged_attention, **opts, interpret=interpret), args,
                functools.partial(paged_attention_reference, **opts), args)
    if kernel == "sparse":
        args = decode + tuple(x.selection)
        return (functools.partial(sparse_paged_decode_attention, **opts, interpret=interpret),
                args, functools.partial(sparse_decode_reference, **opts), args)
    splits = kernel.split("=")[1]
    return (functools.partial(paged_decode_attention, **opts, interpret=interpret,
                              num_splits=None if splits == "auto" else int(splits)), decode,
            functools.partial(paged_attention_reference, **opts), decode + (x.qsl_d,))


def correctness_row(run: Run, kernel: str, pool: str, variant: str, opts: dict,
                    x: Inputs) -> dict | None:
    """One kernel on one pool and option set vs its reference (None in an abstract pass); a ragged
    row also needs zeros for the padding tokens."""
    dtype = "float32" if pool == "float32" else "bfloat16"
    row = dict(kernel=kernel, pool=pool, variant=variant, dtype=dtype)
    s = run.settings
    try:
        if kernel == "sparse" and x.selection is None:      # Quest's pages, once per pool
            select = functools.partial(quest_pages, budget=s.sparse_budgets[0] // s.block_size,
                                       num_sinks=s.sparse_sinks, recent=s.sparse_recent)
            x.selection = run.call("quest select", select, x.qd, x.k, x.tables, x.lens)
        fn, args, ref, ref_args = kernel_calls(kernel, opts, x, s.interpret)
        got = run.call("check", fn, *args)
        want = run.call("reference", ref, *ref_args)
        if run.abstract:
            return None
        n = x.n if kernel == "ragged" else got.shape[0]
        row.update(max_err=max_err(got[:n], want[:n]),
                   ok=is_close(got[:n], want[:n], dtype) and bool(jnp.all(got[n:] == 0)))
    except Exception as e:  # noqa: BLE001 - recorded, the other rows go on
        traceback.print_exc()
        run.errors.append(f"correctness {kernel} {pool} {variant}: {type(e).__name__}: "
                          f"{str(e)[:200]}")
        row.update(max_err=float("nan"), ok=False)
    return row


def check_correctness(run: Run) -> dict:
    """{"ours": rows, "peer": rows}: ``Settings.pools``' kernels x option sets x pools, and jax's
    paged_attention on the bf16 pool (a failing peer is an error of the run)."""
    s = run.settings
    tables, lens = page_tables(s.kv_lens, s.block_size)
    base = run.data(functools.partial(random_pools, 1, 1 + int(np.sum(tables > 0)), s,
                                      jnp.bfloat16))
    rows, peer = [], []
    for pool, variants, kernels in s.pools:
        try:
            x = pool_inputs(run, pool, base, tables, lens)
        except Exception as e:  # noqa: BLE001 - recorded, the other pools go on
            traceback.print_exc()
            run.errors.append(f"correctness {pool}: {type(e).__name__}: {str(e)[:200]}")
            rows.append(dict(kernel=", ".join(kernels), pool=pool, variant="-", dtype="-",
                             max_err=float("nan"), ok=False))
            continue
        for variant in variants:
            opts = variant_options(variant, s)
            for kernel in kernels:
                if kernel == "sparse" and set(opts) - {"soft_cap"}:
                    continue                      # the sparse kernel takes no window
                row = correctness_row(run, kernel, pool, variant, opts, x)
                rows += [row] if row else []
        if pool == "bfloat16":
            peer = check_peer(run, x)
    return dict(ours=rows, peer=peer)


def check_peer(run: Run, x: Inputs) -> list[dict]:
    try:
        fn = functools.partial(peer_paged_attention, interpret=run.settings.interpret)
        got = run.call("check", fn, x.qd, run.data(to_hnd, x.k), run.data(to_hnd, x.v),
                       x.tables, x.lens)
        want = run.call("reference", paged_attention_reference, x.qd, x.k, x.v, x.tables,
                        x.lens, x.qsl_d)
    except Exception as e:  # noqa: BLE001 - the peer is not under test
        run.errors.append(f"peer correctness: {type(e).__name__}: {str(e)[:200]}")
        return []
    if run.abstract:
        return []
    return [dict(kernel="jax paged_attention (peer)", pool="bfloat16", variant="plain",
                 dtype="bfloat16", max_err=max_err(got, want), ok=is_close(got, want,
                                                                           "bfloat16"))]


# --------------------------------------------------------------------------------------------
# (b) decode bandwidth
# --------------------------------------------------------------------------------------------


def bench_decode(run: Run) -> list[dict]:
    """bf16 rows per (context, GQA, batch), longest context first; after each context in
    ``quant_contexts`` its quantized rows (``bench_quant_decode``) on the same pools."""
    s = run.settings
    rows = []
    per_ctx = len(s.groups) * len(s.batches)
    for ctx in sorted(s.contexts, reverse=True):
        if run.late("decode", per_ctx):
            continue
        k, v, tables_all, _ = make_paged(run, ctx, [ctx] * max(s.batches))
        hnd = (run.data(to_hnd, k), run.data(to_hnd, v))
        bf16_rows = {}
        for G in s.groups:
            for B in s.batches:
                if run.late("decode"):
                    continue
                row = decode_row(run, ctx, G, B, k, v, hnd, tables_all[:B])
                if row is not None:
                    rows.append(row)
                    bf16_rows[G, B] = row
        del hnd
        gc.collect()
        if ctx in s.quant_contexts:
            rows += bench_quant_decode(run, bf16_rows, ctx, k, v, tables_all)
        del k, v
        gc.collect()
    return rows


def decode_row(run: Run, ctx: int, G: int, B: int, k, v, hnd, tables) -> dict | None:
    """Our split-K kernel, the ragged kernel and the peer on one decode batch."""
    s = run.settings
    lens = jnp.full((B,), ctx, jnp.int32)
    q = normal(run, B, (B, G * s.num_kv_heads, s.head_dim))
    kv_bytes = B * ctx * s.num_kv_heads * s.head_dim * 2 * 2
    row = dict(batch=B, context=ctx, group=G, kv_bytes=kv_bytes)
    for name, fn, args in (
            ("ours", functools.partial(paged_decode_attention, interpret=s.interpret),
             (q, k, v, tables, lens)),
            ("ragged", functools.partial(ragged_decode, interpret=s.interpret),
             (q, k, v, tables, lens)),
            ("peer", functools.partial(peer_paged_attention, interpret=s.interpret),
             (q, *hnd, tables, lens))):
        run.timed(row, name, "decode", fn, args, kv_bytes)
    if run.abstract:
        return None
    print(fmt_decode_row(row), flush=True)
    return row


def bench_quant_decode(run: Run, bf16_rows: dict, ctx: int, k, v, tables_all) -> list[dict]:
    """Decode rows of the quantized pools (each dtype quantized once from the context's bf16
    pools) for the batches of the bf16 rows at GQA ``quant_groups``, same q: ms, GB/s over the
    bytes the kernel reads (``read_bytes``) and the speedup over the bf16 row's time."""
    from jaxkv.attention.pallas.kv_format import check_pallas_support

    s = run.settings
    rows = []
    for kv in s.quant_dtypes:
        if run.late("quant", len(s.quant_groups) * len(s.batches)):
            continue
        try:
            check_pallas_support(KVCacheSpec(num_layers=1, num_blocks=2, block_size=s.block_size,
                                             num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                             dtype="bfloat16", kv_cache_dtype=kv))
        except ValueError as e:
            print(f"skipping {kv} decode rows: {e}", flush=True)
            continue
        kq, vq = run.data(functools.partial(quantized_pools, kv_cache_dtype=kv), k, v)
        for G in s.quant_groups:
            for B in s.batches:
                bf16 = bf16_rows.get((G, B), {})
                timed_bf16 = run.abstract or "ours_ms" in bf16
                if timed_bf16 and not run.late("quant"):
                    row = quant_row(run, kv, ctx, G, B, kq, vq, tables_all[:B], bf16)
                    rows += [row] if row else []
        del kq, vq
        gc.collect()
    return rows


def quant_row(run: Run, kv: str, ctx: int, G: int, B: int, kq, vq, tables, bf16: dict):
    s = run.settings
    lens = jnp.full((B,), ctx, jnp.int32)
    q = normal(run, B, (B, G * s.num_kv_heads, s.head_dim))
    fn = functools.partial(paged_decode_attention, interpret=s.interpret)
    pages = B * -(-ctx // s.block_size)
    kv_bytes = read_bytes(kq, pages) + read_bytes(vq, pages)
    row = dict(batch=B, context=ctx, group=G, kv_bytes=kv_bytes, kv_cache_dtype=kv)
    run.timed(row, "ours", "decode", fn, (q, kq, vq, tables, lens), kv_bytes)
    if run.abstract:
        return None
    row.update(bf16_ms=bf16["ours_ms"], bf16_kv_bytes=bf16["kv_bytes"])
    if "ours_ms" in row:
        row["speedup_vs_bf16"] = bf16["ours_ms"] / row["ours_ms"]
        target = QUANT_TARGETS.get(kv) if ctx == s.target_context else None
        if target is not None:
            row.update(target=target, target_met=row["speedup_vs_bf16"] >= target)
    print(fmt_quant_row(row), flush=True)
    return row


# --------------------------------------------------------------------------------------------
# copy bandwidth, (c) prefill
# --------------------------------------------------------------------------------------------


def increment(x):
    return x + 1


def copy_bandwidth(run: Run) -> float:
    """Device-to-device copy bandwidth in GB/s: x + 1 reads and writes copy_bytes each."""
    n = run.settings.copy_bytes
    x = run.data(lambda: jnp.zeros((n // 2,), jnp.bfloat16))
    row = {}
    run.timed(row, "copy", "copy", increment, (x,), est_s=2 * n / 3e12)
    if "copy_error" in row:
        raise RuntimeError(row["copy_error"])
    return 0.0 if run.abstract else 2 * n / row["copy_ms"] * 1e3 / 1e9


def dense_kv(pool, tables):
    """[1, T, Hkv, D]: the first sequence's positions of ``pool``, in order."""
    bs = pool.shape[1]
    pos = jnp.arange(tables.shape[1] * bs)
    return pool[tables[0, pos // bs], pos % bs][None]


def mha_repeated(q, k, v, *, sm_scale: float, interpret: bool):
    """Pallas' dense flash attention (ops.gpu.attention.mha), K/V repeated to every q head."""
    from jax.experimental.pallas.ops.gpu import attention

    G = q.shape[1] // k.shape[2]
    return attention.mha(q[None], jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2), None,
                         sm_scale=sm_scale, causal=True, interpret=interpret)


def dense_dpa(q, k, v, *, scale: float, implementation: str):
    return jax.nn.dot_product_attention(q[None], k, v, scale=scale, is_causal=True,
                                        implementation=implementation)


def bench_prefill(run: Run) -> list[dict]:
    """One causal prompt of ``prefill_tokens``: the ragged kernel at each of ``prefill_configs``,
    then ``prefill_peers`` on the dense K/V: ms and TFLOP/s."""
    s = run.settings
    D, Hkv, T = s.head_dim, s.num_kv_heads, s.prefill_tokens
    Hq = 4 * Hkv
    k, v, tables, lens = make_paged(run, 3, [T])
    q = normal(run, 4, (T, Hq, D))
    dense = (q, run.data(dense_kv, k, tables), run.data(dense_kv, v, tables))
    flops = 4 * Hq * D * T * (T + 1) / 2                        # causal: QK^T and PV
    impl = "xla" if s.interpret else "cudnn"
    cases = [(f"jaxkv ragged (paged) {cfg or 'default'}",
              functools.partial(ragged_paged_attention, config=cfg, interpret=s.interpret),
              (q, k, v, tables, lens, jnp.asarray([0, T], jnp.int32)))
             for cfg in s.prefill_configs]
    peers = {"mha": ("pallas ops.gpu.attention.mha (dense, K/V repeated)",
                     functools.partial(mha_repeated, sm_scale=1 / math.sqrt(D),
                                       interpret=s.interpret)),
             "dpa": (f"jax.nn.dot_product_attention (dense, {impl})",
                     functools.partial(dense_dpa, scale=1 / math.sqrt(D), implementation=impl))}
    cases += [(*peers[p], dense) for p in s.prefill_peers]
    rows = []
    for name, fn, args in cases:
        row = dict(kernel=name, tokens=T, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, flops=flops)
        run.timed(row, None, "prefill", fn, args, est_s=flops / 300e12)
        if run.abstract:
            continue
        if "ms" in row:
            row["tflops"] = flops / row["ms"] / 1e9
        rows.append(row)
        print(row, flush=True)
    return rows


# --------------------------------------------------------------------------------------------
# (b3) Quest sparse decode, (b4) kept-blocks decode
# --------------------------------------------------------------------------------------------


def quest_decode(q, k, v, tables, lens, bounds, *, budget: int, num_sinks: int, recent: int,
                 interpret: bool):
    """The whole sparse step: page scores from ``bounds``, the top pages, the sparse kernel."""
    from jaxkv.attention.pallas import sparse_paged_decode_attention
    from jaxkv.attention.quest import quest_select

    pages, count = quest_select(q, k, tables, lens, budget=budget, bounds=bounds,
                                num_sinks=num_sinks, recent=recent)
    return sparse_paged_decode_attention(q, k, v, tables, lens, pages, count,
                                         interpret=interpret)


def bench_sparse(run: Run) -> list[dict]:
    """Quest sparse decode rows: per (context, batch) the dense split-K kernel, then per token
    budget the pages Quest selects, the sparse kernel vs ``sparse_decode_reference`` on them,
    and the timings of the kernel alone and of the whole step (scores + selection + kernel).
    Bytes read: the selected pages' K and V for the kernel, plus the f32 kmin/kmax of every page
    of every sequence for the whole step."""
    from jaxkv.attention.quest import key_bounds

    s = run.settings
    rows = []
    for ctx in s.sparse_contexts:
        for B in s.sparse_batches:
            if run.late("sparse", len(s.sparse_budgets)):
                continue
            k, v, tables, lens = make_paged(run, 100 + ctx, [ctx] * B)
            q = normal(run, B, (B, 4 * s.num_kv_heads, s.head_dim))
            args = (q, k, v, tables, lens)
            dense = dict(batch=B, context=ctx, group=4,
                         dense_bytes=B * ctx * s.num_kv_heads * s.head_dim * 2 * 2)
            run.timed(dense, "dense", "decode",
                      functools.partial(paged_decode_attention, interpret=s.interpret), args,
                      dense["dense_bytes"])
            if "dense_error" in dense:
                rows.append(dense)
                continue
            bounds = run.call("key bounds", key_bounds, k, tables, lens)
            for budget in s.sparse_budgets:
                if not run.late("sparse"):
                    row = sparse_row(run, dict(dense, budget_tokens=budget), args, bounds)
                    rows += [row] if row else []
            del k, v, bounds
            gc.collect()
    return rows


def sparse_row(run: Run, row: dict, args, bounds) -> dict | None:
    from jaxkv.attention.pallas import sparse_paged_decode_attention
    from jaxkv.attention.quest import sparse_decode_reference

    s = run.settings
    B, ctx = row["batch"], row["context"]
    opts = dict(budget=row["budget_tokens"] // s.block_size, num_sinks=s.sparse_sinks,
                recent=s.sparse_recent)
    page_bytes = s.block_size * s.head_dim * 2 * 2               # K + V of one page, one head
    bounds_bytes = 2 * B * (ctx // s.block_size) * s.num_kv_heads * s.head_dim * 4
    est = B * s.num_kv_heads * opts["budget"] * page_bytes / 3e12 + 5e-6
    q, k, _, tables, lens = args
    try:
        pages, count = run.call("quest select", functools.partial(quest_pages, **opts), q, k,
                                tables, lens)
        kernel = functools.partial(sparse_paged_decode_attention, interpret=s.interpret)
        got = run.call("check", kernel, *args, pages, count)
        want = run.call("reference", sparse_decode_reference, *args, pages, count)
        kv_read = None if run.abstract else int(jnp.sum(count)) * page_bytes
        if kv_read is not None:
            row.update(pages_read=kv_read // page_bytes, kernel_bytes=kv_read,
                       quest_bytes=kv_read + bounds_bytes, max_err=max_err(got, want),
                       ok=is_close(got, want, "bfloat16"))
        run.timed(row, "kernel", "sparse", kernel, (*args, pages, count), kv_read, est_s=est)
        run.timed(row, "quest", "sparse step",
                  functools.partial(quest_decode, **opts, interpret=s.interpret), (*args, bounds),
                  None if kv_read is None else kv_read + bounds_bytes, est_s=est)
        if run.abstract:
            return None
        for name in ("kernel", "quest"):
            if f"{name}_error" in row:
                raise RuntimeError(row[f"{name}_error"])
            row[f"{name}_speedup"] = row["dense_ms"] / row[f"{name}_ms"]
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(fmt_sparse_row(row), flush=True)
    return row


def thin_tables(tables: np.ndarray, kv_lens, *, bs: int, fraction: float, seed: int):
    """int32 tables keeping ``round(fraction * blocks)`` of each sequence's blocks (its last one
    and a random choice of the others, at least 1), the rest set to the null block 0."""
    rng = np.random.default_rng(seed)
    tables = np.array(tables)
    for s, n in enumerate(np.asarray(kv_lens)):
        nb = -(-int(n) // bs)
        keep = max(1, round(fraction * nb))
        kept = np.append(rng.choice(nb - 1, keep - 1, replace=False), nb - 1)
        tables[s, np.setdiff1d(np.arange(nb), kept)] = 0
    return jnp.asarray(tables)


def bench_kept(run: Run) -> list[dict]:
    """Kept-blocks decode rows: per (context, batch), the split-K decode kernel on a table keeping
    ``kept_fraction`` of each sequence's blocks, walking the kept blocks (no window: the default)
    and walking every logical tile of the same table (``sliding_window=context``, which sees
    every position, so the same attention). Bytes: the kept pages' K+V for the kept walk, every
    logical position's K+V for the dense one (its null-block gathers hit one cached page, so
    its HBM traffic is nearer the kept bytes; the time is what it saves)."""
    s = run.settings
    rows = []
    for ctx in s.kept_contexts:
        for B in s.kept_batches:
            if run.late("kept"):
                continue
            row = kept_row(run, ctx, B)
            rows += [row] if row else []
            gc.collect()
    return rows


def kept_row(run: Run, ctx: int, B: int) -> dict | None:
    s = run.settings
    page_bytes = s.block_size * s.num_kv_heads * s.head_dim * 2 * 2      # K + V of one page
    k, v, full, lens = make_paged(run, 200 + ctx, [ctx] * B)
    tables = thin_tables(np.asarray(full), lens, bs=s.block_size, fraction=s.kept_fraction,
                         seed=B)
    q = normal(run, B, (B, 4 * s.num_kv_heads, s.head_dim))
    kept_pages = int(jnp.sum(tables != 0))
    row = dict(batch=B, context=ctx, group=4, kept_pages=kept_pages,
               logical_pages=int(full.size), kept_bytes=kept_pages * page_bytes,
               dense_bytes=int(full.size) * page_bytes)
    walks = {"kept": functools.partial(paged_decode_attention, interpret=s.interpret),
             "dense": functools.partial(paged_decode_attention, sliding_window=ctx,
                                        interpret=s.interpret)}
    try:
        outs = {name: run.call("check", fn, q, k, v, tables, lens) for name, fn in walks.items()}
        for name, fn in walks.items():
            run.timed(row, name, "decode", fn, (q, k, v, tables, lens), row[f"{name}_bytes"])
        if run.abstract:
            return None
        row.update(max_err=max_err(outs["kept"], outs["dense"]),
                   ok=is_close(outs["kept"], outs["dense"], "bfloat16"),
                   speedup=row["dense_ms"] / row["kept_ms"])
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(fmt_kept_row(row), flush=True)
    return row


# --------------------------------------------------------------------------------------------
# (b5) absorbed MLA decode
# --------------------------------------------------------------------------------------------

MLA_SCALE = 0.135          # DeepSeek-V3's softmax scale (jaxkv.model.mla.softmax_scale)
MLA_CONFIGS = {"ours": None, "h64": MLADecodeConfig(block_h=64)}   # head tiles of 16 and 64
MLA_FP8 = "fp8_e4m3"       # the fp8 latent: codes + one bf16 scale per token


def bench_mla(run: Run) -> list[dict]:
    """(b5) the MLA decode kernel per context (longest first) and batch on one bf16 latent pool
    [blocks, block_size, 1, Lkv + R] per context: ``mla_row``."""
    s = run.settings
    rows = []
    for ctx in sorted(s.mla_contexts, reverse=True):
        if run.late("mla", len(s.mla_batches)):
            continue
        tables, _ = page_tables([ctx] * max(s.mla_batches), s.block_size)
        pool = run.data(functools.partial(latent_pool, ctx, 1 + int(np.sum(tables > 0)), s))
        pools = {"bf16": pool, "fp8": run.data(fp8_latent_pool, pool)}
        for B in s.mla_batches:
            if not run.late("mla"):
                row = mla_row(run, ctx, B, pools, jnp.asarray(tables[:B]))
                rows += [row] if row else []
        del pool, pools
        gc.collect()
    return rows


def latent_pool(seed: int, num_blocks: int, s: Settings):
    """A latent pool [num_blocks, block_size, 1, Lkv + R] of normal bf16 values."""
    shape = (num_blocks, s.block_size, 1, sum(s.mla_latent))
    return jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)


@jax.jit
def fp8_latent_pool(pool):
    """The bf16 latent ``pool`` as the engine's fp8 latent cache holds it (``QuantizedPages``:
    e4m3 codes [blocks, block_size, 1, Lkv + R], bf16 scales [blocks, block_size, 1, 1]); codes
    of 2-4 GiB (which the kernels refuse: ``kv_format.check_offsets``) get unused zero blocks
    past 4 GiB, as a pool sized for them would."""
    from jaxkv.kvcache.pools import quantize_pages

    block_bytes = math.prod(pool.shape[1:])                 # 1-byte codes
    if 2 ** 31 < pool.shape[0] * block_bytes <= 2 ** 32:
        pad = 2 ** 32 // block_bytes + 1 - pool.shape[0]
        pool = jnp.concatenate([pool, jnp.zeros((pad, *pool.shape[1:]), pool.dtype)])
    return quantize_pages(pool, MLA_FP8, axis="token")


def mla_reference(q, pool, tables, lens, *, kv_lora_rank: int):
    """``mla_attention_reference`` on a decode batch (sequence s's token is q[s])."""
    qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return mla_attention_reference(q, pool, tables, lens, qsl, kv_lora_rank=kv_lora_rank,
                                   sm_scale=MLA_SCALE)


def mla_looped(q, pool, tables, lens, *, kv_lora_rank: int, interpret: bool, config):
    """The kernel's o_lat [S, N, Lkv] with q's rotary channels: q's shape, for ``looped``."""
    o = mla_decode_attention(q, pool, tables, lens, kv_lora_rank=kv_lora_rank,
                             sm_scale=MLA_SCALE, interpret=interpret, config=config)
    return jnp.concatenate([o, q[..., kv_lora_rank:]], axis=-1)


def mla_row(run: Run, ctx: int, B: int, pools: dict, tables) -> dict | None:
    """Each of ``MLA_CONFIGS`` timed on one decode batch over the bf16 latent, and the default
    config over the fp8 one: ms, GB/s over the latent bytes read once, fraction of copy; at
    batch 1 each pool's kernel output vs the spec over that pool. ``ok``: every timing ran
    and (batch 1) the outputs are within bf16 tolerance."""
    s = run.settings
    Lkv, R = s.mla_latent
    lens = jnp.full((B,), ctx, jnp.int32)
    q = normal(run, B, (B, s.mla_heads, Lkv + R))
    row = dict(batch=B, context=ctx, heads=s.mla_heads, latent_bytes=B * ctx * (Lkv + R) * 2,
               fp8_bytes=B * ctx * (Lkv + R + 2))
    runs = [(name, pools["bf16"], config, row["latent_bytes"])
            for name, config in MLA_CONFIGS.items()] + [("fp8", pools["fp8"], None,
                                                          row["fp8_bytes"])]
    try:
        for name, pool, config, nbytes in runs:
            fn = functools.partial(mla_looped, kv_lora_rank=Lkv, interpret=s.interpret,
                                   config=config)
            run.timed(row, name, "mla", fn, (q, pool, tables, lens), nbytes)
        close, checks = True, (("", pools["bf16"]), ("fp8_", pools["fp8"])) if B == 1 else ()
        for prefix, pool in checks:
            got = run.call("check", functools.partial(
                mla_decode_attention, kv_lora_rank=Lkv, sm_scale=MLA_SCALE,
                interpret=s.interpret), q, pool, tables, lens)
            want = run.call("check", functools.partial(mla_reference, kv_lora_rank=Lkv),
                            q, pool, tables, lens)
            if not run.abstract:
                row[f"{prefix}max_err"] = max_err(got, want)
                close = close and is_close(got, want, "bfloat16")
        row["ok"] = close and not any(k.endswith("_error") for k in row)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if run.abstract:
        return None
    print(fmt_mla_row(row), flush=True)
    return row


# --------------------------------------------------------------------------------------------
# (g) quantized weights
# --------------------------------------------------------------------------------------------


def bench_weights(run: Run) -> list[dict]:
    """Weights kept in GGUF blocks (issue 51): ``quantized_matmul`` over square [K, K] weights
    (Llama-3-8B's q/o_proj at 4096, Llama-3-70B's at 8192; square, so the timing loop feeds
    each output back as the next x) at each batch of rows, bf16 activations: ms, GB/s over the
    stored bytes (codes + f16 scales + minimums; Q4_K's and Q6_K's scales f32), fraction of
    copy; the bf16 product of the dequantized weight (XLA's GEMM) beside it and the speed-up;
    the kernel's output against float32 dequantize-then-dot."""
    s = run.settings
    rows = []
    for K in s.weight_sizes:
        for qtype in s.weight_formats:
            w = run.data(functools.partial(random_blocks, K, qtype))
            dense = run.data(functools.partial(dequantize, dtype=jnp.bfloat16), w)
            for M in s.weight_batches:
                if run.late("weights"):
                    continue
                rows.append(weight_row(run, qtype, M, w, dense))
            gc.collect()
    return rows


# (g)'s formats: (qtype, values per scale (0: per output channel), the scales' dtype); GGUF's
# Q4_K and Q6_K as jaxkv keeps them (jaxkv/model/quantized.py: Q4_1 codes with float32 scales
# and minima per 32, Q8_0 codes with a float32 scale per 16); MXFP4's scales E8M0 bytes
WEIGHT_FORMATS = {"Q8_0": ("Q8_0", 32, jnp.float16), "Q4_1": ("Q4_1", 32, jnp.float16),
                  "Q4_K": ("Q4_1", 32, jnp.float32), "Q6_K": ("Q8_0", 16, jnp.float32),
                  "MXFP4": ("MXFP4", 32, jnp.uint8),
                  "int4-g128": ("Q4_1", 128, jnp.float16), "fp8": ("F8_E4M3", 0, jnp.float16)}


def random_blocks(K: int, fmt: str) -> QuantizedWeight:
    """A [K, K] weight of ``WEIGHT_FORMATS[fmt]``: random codes (fp8: bytes with bit 3 clear,
    never NaN), scales ~1e-2 (MXFP4: 2^-9 .. 2^-5) and (Q4_1, Q4_K) minimums, on the device."""
    qtype, group, scale_dtype = WEIGHT_FORMATS[fmt]
    group = group or K
    kq, kd, km = jax.random.split(jax.random.key(K), 3)
    if qtype == "Q8_0":
        qs = jax.random.randint(kq, (K, K), -128, 128).astype(jnp.int8)
    elif qtype == "F8_E4M3":
        codes = jax.random.randint(kq, (K, K), 0, 256).astype(jnp.uint8) & 0xF7
        qs = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    else:
        qs = jax.random.randint(kq, (K, K // 2), 0, 256).astype(jnp.uint8)
    d = (jax.random.uniform(kd, (K, -(-K // group))) * 0.02).astype(scale_dtype)
    if qtype == "MXFP4":
        d = jax.random.randint(kd, d.shape, 118, 123).astype(jnp.uint8)
    m = (jax.random.normal(km, d.shape) * 0.01).astype(scale_dtype)
    return QuantizedWeight(qs, d, m if qtype == "Q4_1" else None, qtype, (K, K), group)


def dequantized_dot(x, w: QuantizedWeight):
    """The reference: float32 x times float32 dequantized w, transposed, at full precision."""
    return jnp.dot(x.astype(jnp.float32), dequantize(w).T, precision=jax.lax.Precision.HIGHEST)


def weight_row(run: Run, qtype: str, M: int, w: QuantizedWeight, dense) -> dict | None:
    K = w.cols
    row = dict(qtype=qtype, batch=M, size=K, dense_bytes=K * K * 2,
               stored_bytes=sum(nbytes(a) for a in jax.tree.leaves(w)))
    x = normal(run, M, (M, K))
    products = {"kept": functools.partial(quantized_matmul, interpret=run.settings.interpret),
                "dense": lambda x, wd: jnp.dot(x, wd.T)}
    args = {"kept": (x, w), "dense": (x, dense)}
    try:
        got = run.call("check", products["kept"], x, w)
        want = run.call("check", dequantized_dot, x, w)
        for name, fn in products.items():
            run.timed(row, name, "weights", fn, args[name],
                      row["stored_bytes" if name == "kept" else "dense_bytes"])
        if run.abstract:
            return None
        row.update(max_err=max_err(got, want), ok=is_close(got, want, "bfloat16"),
                   speedup=row["dense_ms"] / row["kept_ms"])
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(fmt_weight_row(row), flush=True)
    return row


# --------------------------------------------------------------------------------------------
# (e) host offload, (d) tuning sweep
# --------------------------------------------------------------------------------------------


def bench_offload(run: Run) -> list[dict]:
    """(e) host offload bandwidth: HostKVPool batches, then raw device_put vs jit to pinned host."""
    from jaxkv.kvcache.host_pool import HostKVPool
    from jaxkv.kvcache.pages import init_cache

    s = run.settings
    if run.late("offload"):
        return []
    n_max = max(s.offload_blocks)
    spec = KVCacheSpec(num_layers=s.offload_layers, num_blocks=n_max + 1, block_size=16,
                       num_kv_heads=s.offload_kv_heads, head_dim=s.head_dim, dtype="bfloat16")
    cache = init_cache(spec)
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    rows = []
    for staging in ("none", "pinned_host") if "pinned_host" in kinds else ("none",):
        pool = HostKVPool(cache, n_max, staging=staging)   # "auto" is pinned_host on a GPU
        for n in s.offload_blocks:
            cache, d2h, h2d = pool.measure(cache, n, repeats=s.reps)
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
    return rows + raw_offload(s, dev, spec.block_bytes)


def raw_offload(s: Settings, dev, block_bytes: int) -> list[dict]:
    """A contiguous buffer of n blocks moved by jax.device_put to ``pinned_host`` memory and
    back, and by jitted copies whose outputs live there."""
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    rows = []
    for n in s.offload_blocks:
        x = jnp.ones((n, block_bytes // 2), jnp.bfloat16)
        for path, d2h_fn, h2d_fn in (
                ("device_put pinned_host", lambda a: jax.device_put(a, host),
                 lambda a: jax.device_put(a, on_dev)),
                ("jit out_shardings pinned_host", jax.jit(lambda a: a, out_shardings=host),
                 jax.jit(lambda a: a, out_shardings=on_dev))):
            jax.block_until_ready(h2d_fn(jax.block_until_ready(d2h_fn(x))))   # warm up
            out, back = [], []
            for _ in range(s.reps):
                t0 = time.perf_counter()
                y = jax.block_until_ready(d2h_fn(x))
                t1 = time.perf_counter()
                jax.block_until_ready(h2d_fn(y))
                out.append(t1 - t0)
                back.append(time.perf_counter() - t1)
            rows.append(dict(path=path, blocks=n, block_bytes=block_bytes,
                             d2h_gbps=x.nbytes / np.median(out) / 1e9,
                             h2d_gbps=x.nbytes / np.median(back) / 1e9))
    return rows


def sweep_decode(run: Run) -> list[dict]:
    """The split-K kernel at (batch 8, the longest context) and (the largest batch, the shortest)
    per kv tile x (warps, stages) x splits (auto, twice auto): ms, GB/s, fraction of copy."""
    s = run.settings
    rows = []
    for B, ctx in ((8, max(s.contexts)), (max(s.batches), min(s.contexts))):
        k, v, tables, lens = make_paged(run, 5, [ctx] * B)
        q = normal(run, 6, (B, 4 * s.num_kv_heads, s.head_dim))
        kv_bytes = B * ctx * s.num_kv_heads * s.head_dim * 4
        for block_kv in s.sweep_block_kv:
            auto = default_num_splits(B, s.num_kv_heads, ctx, block_kv)
            for (num_warps, num_stages), splits in ((launch, splits)
                                                    for launch in s.sweep_launch
                                                    for splits in (None, 2 * auto)):
                if run.late("sweep"):
                    continue
                cfg = DecodeConfig(block_kv=block_kv, num_warps=num_warps, num_stages=num_stages)
                row = dict(batch=B, context=ctx, config=str(cfg), num_splits=splits or "auto")
                run.timed(row, None, "decode", functools.partial(
                    paged_decode_attention, config=cfg, num_splits=splits, interpret=s.interpret),
                    (q, k, v, tables, lens), kv_bytes)
                if not run.abstract:
                    rows.append(row)
                    print(row, flush=True)
        del k, v
        gc.collect()
    return rows


# --------------------------------------------------------------------------------------------
# (f) end to end
# --------------------------------------------------------------------------------------------


def bench_e2e(run: Run, models: dict) -> list[dict]:
    """End-to-end rows: per model and KV dtype one ``jaxkv.LLM`` (bf16 weights, the engine's
    default attention for the backend), per batch ``e2e_prompt`` random prompt ids and
    ``e2e_tokens`` greedy output tokens (ignore_eos) per request, after a warm-up generate of
    the same batch and prompt length (compiles excluded; ``recompiles`` counts any in the timed
    run). A row starts only before the "e2e" guard and when the previous row's time (its LLM's
    build included) would not carry it past "e2e_end"."""
    s = run.settings
    total = sum(len(b) for m in s.e2e_models for _, b in m.runs)
    if run.late("e2e_start", total):
        return []
    try:
        from jaxkv import LLM  # noqa: F401 - the engine's imports, checked before any build
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{e}: jaxkv's engine imports it; carry its wheel "
                                  "(bench/README.md, gpu_check.py)") from e
    sizes = dict(prompt=s.e2e_prompt, tokens=s.e2e_tokens)
    rows, last = [], [0.0]
    for m in s.e2e_models:
        for kv, batches in m.runs:
            if run.late("e2e", len(batches)) or run.late("e2e_end", len(batches), last[0]):
                continue
            t0 = time.perf_counter()
            try:
                llm = build_llm(models[m.label].result(), kv, max(batches), **sizes,
                                attention_impl=s.e2e_impl, interpret=s.interpret)
            except Exception as e:  # noqa: BLE001 - recorded, the other models go on
                traceback.print_exc()
                rows += [dict(batch=B, model=m.describe(), kv_cache_dtype=kv,
                              error=f"{type(e).__name__}: {str(e)[:200]}") for B in batches]
                continue
            build_s = time.perf_counter() - t0
            for B in batches:
                if run.late("e2e") or run.late("e2e_end", 1, last[0]):
                    continue
                t_row = time.perf_counter()
                rows.append(e2e_row(llm, B, m, build_s, **sizes,
                                    warmup_tokens=s.e2e_warmup_tokens))
                print(fmt_e2e_row(rows[-1]), flush=True)
                last[0] = time.perf_counter() - t_row + build_s
                build_s = 0.0           # counted in the first row's time only
            llm.close()
    return rows


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def write(report, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(markdown(report))


def run_sections(run: Run, report: dict, names, out_dir: str | None, models=None) -> None:
    """Each section into ``report[name]`` (a failure into ``report["errors"]``), its seconds
    into ``report["sections_s"]``; the report written after each (unless ``out_dir`` is None)."""
    fns = dict(copy_gbps=copy_bandwidth, correctness=check_correctness, decode=bench_decode,
               prefill=bench_prefill, e2e=lambda r: bench_e2e(r, models), sparse=bench_sparse,
               kept=bench_kept, mla=bench_mla, weights=bench_weights, offload=bench_offload,
               sweep=sweep_decode)
    for name in names:
        run.section = name
        t0 = time.perf_counter()
        try:
            report[name] = fns[name](run)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            traceback.print_exc()
            run.errors.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        if name == "copy_gbps" and not run.abstract:
            run.copy_gbps = report.get("copy_gbps") or 1.0
            print(f"copy bandwidth {run.copy_gbps:.0f} GB/s", flush=True)
        report["sections_s"][name] = round(time.perf_counter() - t0, 1)
        report.update(elapsed_s=run.elapsed(), errors=run.errors, skipped=run.skipped)
        if out_dir is not None:
            write(report, out_dir)


def start_ahead(settings: Settings, exes: artifacts.Executables) -> tuple[threading.Thread, Run]:
    """An abstract pass over (a)-(d) in a thread: every executable the run will ask for is
    lowered there, then compiled (or loaded) by ``exes``' workers while the run goes on."""
    ahead = Run(settings, exes, abstract=True)
    thread = threading.Thread(target=run_sections, daemon=True, args=(
        ahead, dict(sections_s={}), [n for n in settings.sections if n in PREPARED], None))
    thread.start()
    return thread, ahead


def finish_ahead(thread: threading.Thread, ahead: Run, run: Run, report: dict) -> None:
    """Waits for the pass ahead and every executable it started (the end-to-end rows must not
    share the CPU with compiles); its errors become the run's."""
    t0 = time.perf_counter()
    thread.join()
    run.exes.wait()
    run.errors += [f"ahead: {e}" for e in ahead.errors]
    report["ahead"] = dict(done_at_s=round(run.elapsed(), 1),
                           waited_s=round(time.perf_counter() - t0, 1))


def prepare(args, settings: Settings) -> int:
    """--prepare: (a)-(d)'s executables compiled for each target and archived; nothing runs.
    What fails to lower or compile here (cuDNN's attention without the cuDNN library) is listed,
    and the device compiles it. Exit status 1 only if nothing was archived."""
    if not args.dry_run and not jax.config.jax_platforms and "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")   # the CUDA plugin, no GPU: see gpu_target
    archived = 0
    for name in ([None] if args.dry_run else args.target or ["h100_sxm"]):
        target = (artifacts.local_target() if name is None
                  else artifacts.gpu_target(TARGETS / f"{name}.txtpb"))
        writer = artifacts.ArchiveWriter(Path(args.prepare) / f"{target.name}.zip",
                                         dict(artifacts.environment(target.device),
                                              target=target.name))
        exes = artifacts.Executables(target, writer=writer, workers=os.cpu_count() or 1)
        run = Run(settings, exes, abstract=True)
        t0 = time.perf_counter()
        run_sections(run, dict(sections_s={}), [n for n in settings.sections if n in PREPARED],
                     None)
        path = exes.close()
        bad = [f"{r['name']}: {r.get('error')}" for r in exes.records
               if r.get("how") != "prepare"]
        print(f"{path}: {len(writer.entries)} executables, {writer.size / 2**20:.1f} MiB, "
              f"{writer.left_out} left out (size), {len(bad)} not prepared (the device compiles "
              f"them), {time.perf_counter() - t0:.0f} s", flush=True)
        for line in bad + run.errors:
            print(f"  {line}", flush=True)
        archived += len(writer.entries)
    return 0 if archived else 1


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes in Pallas interpret mode on CPU (CI smoke test)")
    parser.add_argument("--quick", action="store_true", help="the < 3 minute selection")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"),
                        help="output folder (default $OUT, else ./out)")
    parser.add_argument("--prepare", metavar="DIR",
                        help="compile (a)-(d) for --target here (deviceless) into DIR/TARGET.zip")
    parser.add_argument("--target", action="append",
                        help="--prepare's tests/gpu_targets/NAME.txtpb (repeatable; h100_sxm)")
    parser.add_argument("--artifacts", action="append", default=[], metavar="PATH",
                        help="load matching executables from these zips or folders of zips")
    parser.add_argument("--no-save-artifacts", action="store_true",
                        help="do not archive this run's compiled executables in OUT/artifacts")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = ((DRY_QUICK if args.quick else DRY) if args.dry_run
                else QUICK if args.quick else FULL)
    if args.prepare:
        return prepare(args, settings)
    target = artifacts.local_target()
    device = target.device
    env = artifacts.environment(device)
    archives, notes = artifacts.open_archives(args.artifacts, env)
    writer = None if args.no_save_artifacts else artifacts.ArchiveWriter(
        Path(args.out) / "artifacts" / f"{slug(device.device_kind)}.zip", env)
    run = Run(settings, artifacts.Executables(target, archives=archives, writer=writer,
                                              roundtrip=args.dry_run,
                                              workers=max(1, (os.cpu_count() or 1) - 2)))
    report = dict(device=f"{device.platform} {device.device_kind}", jax=jax.__version__,
                  python=platform.python_version(), dry_run=args.dry_run, quick=args.quick,
                  copy_gbps=0.0, head_dim=settings.head_dim,
                  target_context=settings.target_context, correctness=dict(ours=[], peer=[]),
                  decode=[], prefill=[], e2e=[], sparse=[], kept=[], mla=[], weights=[], offload=[],
                  sweep=[],
                  errors=[], skipped={}, sections_s={}, elapsed_s=0.0,
                  artifacts=dict(archives=notes))
    names = list(settings.sections)
    cut = names.index("e2e") if "e2e" in names else len(names)
    with tempfile.TemporaryDirectory() as tmp:
        models = write_models(settings.e2e_models, tmp) if "e2e" in names else {}
        thread, ahead = start_ahead(settings, run.exes)
        run_sections(run, report, names[:cut], args.out, models)
        finish_ahead(thread, ahead, run, report)
        run_sections(run, report, names[cut:], args.out, models)
        concurrent.futures.wait(models.values())   # before their folder goes
    saved = run.exes.close()
    if saved is not None and args.dry_run:      # the manifest this process wrote must load here
        _, check = artifacts.open_archives([saved], env)
        if not check[0].endswith(": used"):
            run.errors.append(f"archive check: {check[0]}")
    report["artifacts"].update(saved=str(saved) if saved else None,
                               summary=run.exes.summary())
    report.update(executables=run.exes.records, elapsed_s=run.elapsed(), errors=run.errors)
    write(report, args.out)
    print(markdown(report))
    ok = all(r["ok"] for r in report["correctness"]["ours"]) and not run.errors \
        and all(r.get("ok", False) for r in report["sparse"] + report["kept"] + report["e2e"]
                + report["mla"] + report["weights"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
