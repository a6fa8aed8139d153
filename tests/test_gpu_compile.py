"""The Pallas kernels compiled for an H100 without a GPU (issue 50): PTX, registers, spills, smem.

Every kernel (ragged, split-K decode, Quest sparse decode) at production shapes and a
representative set of options and KV formats is compiled deviceless for an H100 SXM (sm_90a):
``jax.experimental.topologies`` builds a compile-only CUDA device from the target config in
tests/gpu_targets/, ``jax.jit(f).lower(...).compile()`` runs XLA's GPU pipeline (Triton included)
to PTX, and the XLA dump (``xla_dump_to``, per compile) gives each kernel's PTX and its launch
(grid, threads, dynamic shared memory). Each case asserts:

* the compile succeeds (XLA itself refuses a kernel whose shared memory exceeds the target's
  opt-in limit: RESOURCE_EXHAUSTED, see ``test_oversized_tile_is_refused``);
* every kernel's shared memory <= the target's ``shared_memory_per_block_optin`` (232,448 B);
* ``ptxas -v -arch=sm_90a`` on the kernel's PTX: 0 bytes of spill stores and loads, and registers
  <= the case's budget (``REGISTERS``, recorded per jax version: ``REGISTER_JAX``);
* one launch of the kernel with ``32 * num_warps`` threads.

Needs the CUDA wheels at the jaxlib version (``jax-cuda12-plugin``, ``jax-cuda12-pjrt``,
``nvidia-cuda-nvcc-cu12`` for ptxas) and ``JAX_PLATFORMS=cpu`` where no GPU is attached:
.ci/gpu_compile.sh builds that venv twice, jax 0.10.2 on Python 3.11 and jax 0.12.0.1 on 3.12
(``REGISTER_JAX``), and runs ``pytest -m gpu_compile tests/test_gpu_compile.py`` in each.
Without the plugin a selected test is skipped; the default run deselects the ``gpu_compile`` marker.

``JAXKV_GPU_COMPILE_TABLE=path`` writes the cases' Markdown table there at the end of the module
(``python tests/test_gpu_compile.py [path]`` compiles every case and prints it).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.attention.pallas import (DecodeConfig, RaggedConfig, SparseConfig,
                                    default_num_splits, default_ragged_config,
                                    paged_decode_attention, ragged_paged_attention,
                                    sparse_paged_decode_attention)

pytestmark = [pytest.mark.gpu_compile,
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]


@pytest.fixture(autouse=True, scope="module")
def _cuda_compiler():
    """The deviceless CUDA compiler; without it (the main venv) a selected test is skipped. The
    default run deselects the module's marker, so it neither runs nor skips there."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("jax_cuda12_plugin is not installed: the deviceless GPU compile check needs "
                    "jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12 at the jaxlib "
                    "version (.ci/gpu_compile.sh builds that venv)")

TARGETS = Path(__file__).resolve().parent / "gpu_targets"
H100 = TARGETS / "h100_sxm.txtpb"
H200 = TARGETS / "h200.txtpb"
BLOCK_SIZE = 16
MAX_REGISTERS = 255      # per thread on sm_90; ptxas spills past it


# --------------------------------------------------------------------------------------------
# the target, ptxas, one deviceless compile
# --------------------------------------------------------------------------------------------


def smem_limit(target: Path) -> int:
    """The target config's ``shared_memory_per_block_optin`` (bytes a block may opt in to)."""
    return int(re.search(r"shared_memory_per_block_optin:\s*(\d+)", target.read_text()).group(1))


@functools.cache
def target_mesh(target: Path):
    """A one-device mesh of the compile-only CUDA device the target config describes.

    Needs JAX's backends to start CPU-only: with the CUDA plugin installed and no GPU, an unset
    ``jax_platforms`` lets the plugin fail to start, and then it offers no topology.
    """
    from jax._src import xla_bridge
    from jax.experimental import topologies

    if (not xla_bridge.backends_are_initialized() and "JAX_PLATFORMS" not in os.environ
            and not jax.config.jax_platforms):
        jax.config.update("jax_platforms", "cpu")   # only when nothing chose yet (this run)
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=target.read_text(),
                                            topology="1x1x1")
    except NotImplementedError as e:
        pytest.fail(f"no deviceless CUDA topology ({e}): JAX started its backends before this "
                    f"module could pick CPU; run with JAX_PLATFORMS=cpu")
    return topologies.make_mesh(topo, (1,), ("x",))


@functools.cache
def ptxas() -> str:
    """ptxas from the nvidia-cuda-nvcc-cu12 wheel (else on PATH)."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "bin", "ptxas")
        if os.access(path, os.X_OK):
            return path
    path = shutil.which("ptxas")
    if path is None:
        pytest.fail("ptxas not found: install nvidia-cuda-nvcc-cu12 (its nvidia/cuda_nvcc/bin)")
    return path


@dataclasses.dataclass
class Kernel:
    """One Triton kernel of a compiled program: its launch (XLA's thunk) and ptxas' report."""

    name: str
    grid: tuple[int, ...]
    threads: tuple[int, ...]
    smem: int                 # dynamic shared memory of the launch, bytes
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0            # stack frame, bytes
    static_smem: int = 0      # ptxas' static shared memory (Triton's is all dynamic), bytes
    ptx: str = ""             # the PTX module holding the kernel
    ptx_path: str = ""


THUNK = re.compile(r"kCustomKernel\s.*?\]\s+(\S+)\s+grid:\s*\[([\d, ]+)\]"
                   r"\s+threads:\s*\[([\d, ]+)\]\s+shared_memory:\s*(\d+) bytes")


def launches(dump: Path) -> list[Kernel]:
    """Every kernel launch of the (one) program dumped in ``dump``, from its thunk sequence."""
    [path] = glob.glob(str(dump / "*.thunk_sequence.txt"))
    out = []
    for line in Path(path).read_text().splitlines():
        m = THUNK.search(line)
        if m:
            out.append(Kernel(m.group(1), tuple(int(x) for x in m.group(2).split(",")),
                              tuple(int(x) for x in m.group(3).split(",")), int(m.group(4))))
    return out


def run_ptxas(kernel: Kernel, dump: Path) -> None:
    """Fills ``kernel``'s registers, spills, stack and static smem from ``ptxas -v`` on its PTX."""
    entry = re.compile(rf"\.entry\s+{re.escape(kernel.name)}\s*\(")
    files = [p for p in glob.glob(str(dump / "*.ptx")) if entry.search(Path(p).read_text())]
    assert len(files) == 1, f"PTX of {kernel.name}: {files}"
    kernel.ptx_path, kernel.ptx = files[0], Path(files[0]).read_text()
    res = subprocess.run([ptxas(), "-v", "-arch=sm_90a", files[0], "-o", os.devnull],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, f"ptxas failed on {kernel.name}:\n{res.stderr}"
    report = res.stderr.split(f"Compiling entry function '{kernel.name}'", 1)[1]
    report = report.split("Compiling entry function", 1)[0]
    kernel.registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stack, stores, loads = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                     r"(\d+) bytes spill loads", report).groups()
    kernel.stack, kernel.spill_stores, kernel.spill_loads = int(stack), int(stores), int(loads)
    m = re.search(r"(\d+) bytes smem", report)
    kernel.static_smem = int(m.group(1)) if m else 0


def compile_for(target: Path, fn, args, dump: Path, static: dict | None = None,
                with_compiled: bool = False):
    """Compiles ``jax.jit(fn)`` (or a jitted ``fn`` with its ``static`` keywords) for ``target``
    on ``args`` (ShapeDtypeStruct pytrees without sharding); returns (the jaxkv Triton kernels
    with their ptxas reports, compile seconds), and the compiled executable ``with_compiled``.

    Raises:
      jax.errors.JaxRuntimeError: the compile failed (e.g. RESOURCE_EXHAUSTED for shared memory
        past the target's opt-in limit).
    """
    sharding = NamedSharding(target_mesh(target), PartitionSpec())
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    from jax._src import config as jax_config

    # jax > 0.10.2: Pallas-Triton asks the (abstract) mesh for the GPU (gpu_info.get_gpu_info);
    # the topology mesh's abstract mesh carries AbstractDevice(device_kind='NVIDIA H100 ...').
    with jax.sharding.use_abstract_mesh(target_mesh(target).abstract_mesh):
        # an already-jitted fn (the engine step) lowers itself: its donation stays
        lowered = (fn.lower(*args, **(static or {})) if hasattr(fn, "lower")
                   else jax.jit(fn).lower(*args))
    start = time.perf_counter()
    with jax_config.enable_compilation_cache(False):   # a cache hit would compile (dump) nothing
        # newer XLA dumps the PTX only for emitters matching xla_dump_emitter_re
        compiled = lowered.compile(compiler_options={"xla_dump_to": str(dump),
                                                     "xla_dump_emitter_re": "ptx"})
    seconds = time.perf_counter() - start
    limit = smem_limit(target)
    every = launches(dump)
    assert every, f"no kernel launch in the dump {dump}"
    for k in every:    # XLA's own fusions too: a deviceless compile must not exceed the target
        assert k.smem <= limit, f"{k.name}: {k.smem} B shared memory > {limit} B"
    kernels = [k for k in every if k.name.startswith("jaxkv_")]
    triton_calls = compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"')
    assert len(kernels) == triton_calls, (f"{triton_calls} Triton custom calls, jaxkv kernels "
                                          f"launched: {[k.name for k in kernels]}")
    for k in kernels:
        run_ptxas(k, dump)
    keep = {k.ptx_path for k in kernels}
    for p in dump.iterdir():    # keep the thunk sequence and the kernels' PTX for a post-mortem
        if not (p.name.endswith(".thunk_sequence.txt") or str(p) in keep):
            p.unlink()
    return (kernels, seconds, compiled) if with_compiled else (kernels, seconds)


# --------------------------------------------------------------------------------------------
# the cases
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA3_8B = Model("Llama-3-8B", 32, 8, 128)
LLAMA3_70B_TP8 = Model("Llama-3-70B/TP8", 8, 1, 128)    # one of 8 devices: 64/8 q, 8/8 kv heads
SMOLLM2 = Model("SmolLM2", 9, 3, 64)
GEMMA2_9B = Model("Gemma-2-9B", 16, 8, 256)

WINDOW_SINKS = (("num_sinks", 4), ("sliding_window", 4096))
SOFT_CAP = (("soft_cap", 50.0),)
GEMMA2 = (("sliding_window", 4096), ("soft_cap", 50.0))
ALL = (("num_sinks", 4), ("sliding_window", 4096), ("soft_cap", 50.0))


def abstract_pools(num_blocks: int, model: Model, kv: str):
    """(K, V) pools [num_blocks, BLOCK_SIZE, Hkv, D] as ShapeDtypeStructs: bf16 / fp32 arrays, or
    the ``QuantizedPages`` pytrees ``quantize_pages`` makes (fp8/int8 per token; KIVI int4/int2
    keys per channel, values per token, as bench/gpu_check.py quantizes)."""
    from jaxkv.kvcache.pools import quantize_pages

    dtype = jnp.float32 if kv == "fp32" else jnp.bfloat16
    pool = jax.ShapeDtypeStruct((num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim),
                                dtype)
    if kv in ("bf16", "fp32"):
        return pool, pool
    key_axis = "channel" if kv in ("int4", "int2") else "token"
    return (jax.eval_shape(functools.partial(quantize_pages, kv_cache_dtype=kv, axis=key_axis),
                           pool),
            jax.eval_shape(functools.partial(quantize_pages, kv_cache_dtype=kv, axis="token"),
                           pool))


@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel call at one shape.

    Attributes:
      kernel: ``"ragged"`` (ragged_paged_attention: the engine's prefill + decode step),
        ``"decode"`` (paged_decode_attention, split-K) or ``"sparse"``
        (sparse_paged_decode_attention over Quest's pages).
      seqs: sequences S (the decode batch).
      tokens: the ragged step's tokens T (default ``seqs``: a decode step).
      context: kv positions each block table holds; the pool holds every sequence's
        (``seqs * context / 16 + 1`` blocks of 16).
      kv: pool format: bf16, fp32 (q in the pool's dtype), fp8_e4m3, int8, int4, int2 (bf16 q).
      options: the kernel's keyword options (sorted items).
      q_sinks: pass StreamingLLM's sink queries (the rescore path).
      config: the kernel's config (default: the kernel's own default for the shape).
      pages: Quest's selected pages per (sequence, kv head) (sparse).
    """

    kernel: str
    model: Model
    seqs: int
    context: int
    kv: str = "bf16"
    tokens: int | None = None
    options: tuple = ()
    q_sinks: bool = False
    config: RaggedConfig | DecodeConfig | None = None
    pages: int = 128

    @property
    def num_tokens(self) -> int:
        return self.tokens if self.kernel == "ragged" and self.tokens else self.seqs

    def effective_config(self):
        m = self.model
        if self.config is not None:
            return self.config
        if self.kernel == "ragged":
            return default_ragged_config(self.num_tokens, self.seqs,
                                         m.num_heads // m.num_kv_heads, m.head_dim)
        return SparseConfig() if self.kernel == "sparse" else DecodeConfig()

    def num_splits(self) -> int | None:
        if self.kernel == "ragged":
            return None
        kv_len = self.pages * BLOCK_SIZE if self.kernel == "sparse" else self.context
        return default_num_splits(self.seqs, self.model.num_kv_heads, kv_len,
                                  self.effective_config().block_kv)

    def call(self):
        """(fn, abstract args) of the kernel call."""
        m, S = self.model, self.seqs
        max_blocks = self.context // BLOCK_SIZE
        k, v = abstract_pools(S * max_blocks + 1, m, self.kv)
        dtype = jnp.float32 if self.kv == "fp32" else jnp.bfloat16
        q = jax.ShapeDtypeStruct((self.num_tokens, m.num_heads, m.head_dim), dtype)
        i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
        meta = [i32((S, max_blocks)), i32((S,))]
        opts = dict(self.options, config=self.config)
        if self.kernel == "sparse":
            fn = sparse_paged_decode_attention
            meta += [i32((S, m.num_kv_heads, self.pages)), i32((S, m.num_kv_heads))]
        elif self.kernel == "decode":
            fn = paged_decode_attention
        else:
            fn = ragged_paged_attention
            meta.append(i32((S + 1,)))
        args = [q, k, v, *meta]
        if not self.q_sinks:
            return functools.partial(fn, **opts), args

        def with_sink_queries(*args):          # the sink queries, like q, come last
            return fn(*args[:-1], q_sinks=args[-1], **opts)

        return with_sink_queries, [*args, q]

    def describe(self) -> tuple[str, str]:
        """(options, shape) as the table shows them."""
        c = self.effective_config()
        tiles = (f"bq{c.block_q}/" if isinstance(c, RaggedConfig) else "") + \
            f"bkv{c.block_kv}/w{c.num_warps}/s{c.num_stages}"
        if self.num_splits():
            tiles += f"/splits{self.num_splits()}"
        opts = [f"{k}={v:g}" for k, v in self.options] + (["q_sinks"] if self.q_sinks else [])
        m = self.model
        shape = (f"{m.name} ({m.num_heads}q/{m.num_kv_heads}kv x{m.head_dim}), "
                 f"S={self.seqs}" + (f" T={self.num_tokens}" if self.kernel == "ragged" else "")
                 + f", ctx {self.context // 1024}K"
                 + (f", {self.pages} pages" if self.kernel == "sparse" else ""))
        return ", ".join([self.kv, *opts, tiles]), shape


MIXED = dict(seqs=16, tokens=512)     # a mixed step: 512 tokens over 16 sequences

CASES = {
    # ragged: the engine's attention (prefill chunks and decodes in one launch)
    "ragged-8b-mixed-4k": Case("ragged", LLAMA3_8B, context=4096, **MIXED),
    "ragged-8b-mixed-32k": Case("ragged", LLAMA3_8B, context=32768, **MIXED),
    "ragged-8b-decode1-32k": Case("ragged", LLAMA3_8B, seqs=1, context=32768),
    "ragged-8b-decode16-4k": Case("ragged", LLAMA3_8B, seqs=16, context=4096),
    "ragged-8b-decode256-4k": Case("ragged", LLAMA3_8B, seqs=256, context=4096),
    # a pool of 2^32 B + 32 KiB per layer: the lowering switches to 64-bit offsets
    "ragged-8b-decode64-32k-wide": Case("ragged", LLAMA3_8B, seqs=64, context=32768),
    "ragged-70b-mixed-32k": Case("ragged", LLAMA3_70B_TP8, context=32768, **MIXED),
    "ragged-70b-decode256-4k": Case("ragged", LLAMA3_70B_TP8, seqs=256, context=4096),
    "ragged-smol-mixed-4k": Case("ragged", SMOLLM2, context=4096, **MIXED),
    "ragged-smol-decode256-4k": Case("ragged", SMOLLM2, seqs=256, context=4096),
    "ragged-8b-mixed-4k-fp32": Case("ragged", LLAMA3_8B, context=4096, kv="fp32", **MIXED),
    "ragged-8b-mixed-32k-fp8": Case("ragged", LLAMA3_8B, context=32768, kv="fp8_e4m3", **MIXED),
    "ragged-8b-mixed-32k-int8": Case("ragged", LLAMA3_8B, context=32768, kv="int8", **MIXED),
    "ragged-8b-mixed-32k-int4": Case("ragged", LLAMA3_8B, context=32768, kv="int4", **MIXED),
    "ragged-8b-mixed-32k-int2": Case("ragged", LLAMA3_8B, context=32768, kv="int2", **MIXED),
    "ragged-8b-decode256-4k-int4": Case("ragged", LLAMA3_8B, seqs=256, context=4096, kv="int4"),
    "ragged-smol-mixed-4k-int4": Case("ragged", SMOLLM2, context=4096, kv="int4", **MIXED),
    "ragged-8b-mixed-32k-window-sinks": Case("ragged", LLAMA3_8B, context=32768,
                                             options=WINDOW_SINKS, **MIXED),
    "ragged-8b-mixed-32k-window-qsinks": Case("ragged", LLAMA3_8B, context=32768,
                                              options=WINDOW_SINKS, q_sinks=True, **MIXED),
    "ragged-8b-mixed-32k-softcap": Case("ragged", LLAMA3_8B, context=32768, options=SOFT_CAP,
                                        **MIXED),
    "ragged-8b-mixed-32k-fp8-all": Case("ragged", LLAMA3_8B, context=32768, kv="fp8_e4m3",
                                        options=ALL, **MIXED),
    "ragged-gemma2-mixed-32k": Case("ragged", GEMMA2_9B, context=32768, options=GEMMA2, **MIXED),
    # two corners of bench/gpu_check.py's tuning sweep (block_kv 128; 4 warps x 3 stages,
    # 8 warps x 2 stages)
    "ragged-8b-mixed-32k-bkv128-w4s3": Case("ragged", LLAMA3_8B, context=32768, **MIXED,
                                            config=RaggedConfig(block_q=16, block_kv=128,
                                                                num_warps=4, num_stages=3)),
    "ragged-8b-mixed-32k-bkv128-w8s2": Case("ragged", LLAMA3_8B, context=32768, **MIXED,
                                            config=RaggedConfig(block_q=16, block_kv=128,
                                                                num_warps=8, num_stages=2)),
    # split-K decode
    "decode-8b-1-32k": Case("decode", LLAMA3_8B, seqs=1, context=32768),
    "decode-8b-16-4k": Case("decode", LLAMA3_8B, seqs=16, context=4096),
    "decode-8b-16-32k": Case("decode", LLAMA3_8B, seqs=16, context=32768),
    "decode-8b-256-4k": Case("decode", LLAMA3_8B, seqs=256, context=4096),
    "decode-70b-16-32k": Case("decode", LLAMA3_70B_TP8, seqs=16, context=32768),
    "decode-smol-16-4k": Case("decode", SMOLLM2, seqs=16, context=4096),
    "decode-8b-16-4k-fp32": Case("decode", LLAMA3_8B, seqs=16, context=4096, kv="fp32"),
    "decode-8b-16-32k-fp8": Case("decode", LLAMA3_8B, seqs=16, context=32768, kv="fp8_e4m3"),
    "decode-8b-16-32k-int8": Case("decode", LLAMA3_8B, seqs=16, context=32768, kv="int8"),
    "decode-8b-16-32k-int4": Case("decode", LLAMA3_8B, seqs=16, context=32768, kv="int4"),
    "decode-8b-16-32k-int2": Case("decode", LLAMA3_8B, seqs=16, context=32768, kv="int2"),
    "decode-8b-16-32k-window-sinks": Case("decode", LLAMA3_8B, seqs=16, context=32768,
                                          options=WINDOW_SINKS),
    "decode-8b-16-32k-window-qsinks": Case("decode", LLAMA3_8B, seqs=16, context=32768,
                                           options=WINDOW_SINKS, q_sinks=True),
    "decode-8b-16-32k-softcap": Case("decode", LLAMA3_8B, seqs=16, context=32768,
                                     options=SOFT_CAP),
    "decode-gemma2-16-32k": Case("decode", GEMMA2_9B, seqs=16, context=32768, options=GEMMA2),
    "decode-8b-16-32k-int4-bkv128-w8s2": Case("decode", LLAMA3_8B, seqs=16, context=32768,
                                              kv="int4", config=DecodeConfig(block_kv=128,
                                                                             num_warps=8,
                                                                             num_stages=2)),
    # Quest sparse decode: 128 pages (2,048 tokens) or 32 (512) per (sequence, kv head)
    "sparse-8b-16-32k": Case("sparse", LLAMA3_8B, seqs=16, context=32768),
    "sparse-8b-256-4k": Case("sparse", LLAMA3_8B, seqs=256, context=4096, pages=32),
    "sparse-70b-16-32k": Case("sparse", LLAMA3_70B_TP8, seqs=16, context=32768),
    "sparse-smol-16-4k": Case("sparse", SMOLLM2, seqs=16, context=4096, pages=32),
    "sparse-8b-16-32k-fp8": Case("sparse", LLAMA3_8B, seqs=16, context=32768, kv="fp8_e4m3"),
    "sparse-8b-16-32k-int8": Case("sparse", LLAMA3_8B, seqs=16, context=32768, kv="int8"),
    "sparse-8b-16-32k-int4": Case("sparse", LLAMA3_8B, seqs=16, context=32768, kv="int4"),
    "sparse-8b-16-32k-int2": Case("sparse", LLAMA3_8B, seqs=16, context=32768, kv="int2"),
    "sparse-8b-16-32k-softcap": Case("sparse", LLAMA3_8B, seqs=16, context=32768,
                                     options=SOFT_CAP),
}

# Registers per thread each case's kernel used when its budget was set (ptxas 12.9.86 from
# nvidia-cuda-nvcc-cu12, sm_90a), one column per jax/jaxlib version CI compiles with
# (REGISTER_JAX; .ci/gpu_compile.sh): the Triton that jax ships, hence the PTX, changes between
# them and so do the counts (24 of 49 cases differ, by -79 to +14; docs/gpu.md "Newer JAX"). A
# case is budgeted on its own version's count + 10%, capped at MAX_REGISTERS (255): a kernel at
# 255 today has no headroom left, its next register either spills (the spill assertion trips) or
# is absorbed by ptxas. A jax not listed gets the larger count of the two; a case not listed, 255.
REGISTER_JAX = ("0.10.2", "0.12.0.1")
REGISTERS = {
    "ragged-8b-mixed-4k": (168, 168),
    "ragged-8b-mixed-32k": (168, 168),
    "ragged-8b-decode1-32k": (96, 96),
    "ragged-8b-decode16-4k": (96, 96),
    "ragged-8b-decode256-4k": (96, 96),
    "ragged-8b-decode64-32k-wide": (128, 128),
    "ragged-70b-mixed-32k": (165, 160),
    "ragged-70b-decode256-4k": (96, 96),
    "ragged-smol-mixed-4k": (140, 153),
    "ragged-smol-decode256-4k": (121, 125),
    "ragged-8b-mixed-4k-fp32": (255, 255),
    "ragged-8b-mixed-32k-fp8": (210, 172),
    "ragged-8b-mixed-32k-int8": (197, 172),
    "ragged-8b-mixed-32k-int4": (255, 243),
    "ragged-8b-mixed-32k-int2": (255, 252),
    "ragged-8b-decode256-4k-int4": (207, 128),
    "ragged-smol-mixed-4k-int4": (203, 168),
    "ragged-8b-mixed-32k-window-sinks": (182, 196),
    "ragged-8b-mixed-32k-window-qsinks": (215, 218),
    "ragged-8b-mixed-32k-softcap": (168, 163),
    "ragged-8b-mixed-32k-fp8-all": (175, 175),
    "ragged-gemma2-mixed-32k": (254, 253),
    "ragged-8b-mixed-32k-bkv128-w4s3": (224, 227),
    "ragged-8b-mixed-32k-bkv128-w8s2": (218, 213),
    "decode-8b-1-32k": (96, 96),
    "decode-8b-16-4k": (96, 96),
    "decode-8b-16-32k": (96, 96),
    "decode-8b-256-4k": (128, 128),
    "decode-70b-16-32k": (128, 96),
    "decode-smol-16-4k": (80, 80),
    "decode-8b-16-4k-fp32": (168, 166),
    "decode-8b-16-32k-fp8": (168, 168),
    "decode-8b-16-32k-int8": (128, 128),
    "decode-8b-16-32k-int4": (211, 168),
    "decode-8b-16-32k-int2": (207, 168),
    "decode-8b-16-32k-window-sinks": (118, 118),
    "decode-8b-16-32k-window-qsinks": (123, 120),
    "decode-8b-16-32k-softcap": (96, 96),
    "decode-gemma2-16-32k": (140, 140),
    "decode-8b-16-32k-int4-bkv128-w8s2": (218, 178),
    "sparse-8b-16-32k": (96, 96),
    "sparse-8b-256-4k": (128, 102),
    "sparse-70b-16-32k": (128, 128),
    "sparse-smol-16-4k": (80, 80),
    "sparse-8b-16-32k-fp8": (168, 168),
    "sparse-8b-16-32k-int8": (128, 128),
    "sparse-8b-16-32k-int4": (212, 168),
    "sparse-8b-16-32k-int2": (207, 168),
    "sparse-8b-16-32k-softcap": (96, 96),
}


def recorded_registers(case_id: str, version: str | None = None) -> int | None:
    """The registers ``case_id`` used when its budget was set, on jax ``version`` (default: the
    running one; one not in REGISTER_JAX gets the larger count)."""
    counts = REGISTERS.get(case_id)
    if counts is None:
        return None
    version = jax.__version__ if version is None else version
    return counts[REGISTER_JAX.index(version)] if version in REGISTER_JAX else max(counts)


def register_budget(case_id: str, version: str | None = None) -> int:
    today = recorded_registers(case_id, version)
    return MAX_REGISTERS if today is None else min(MAX_REGISTERS, -(-today * 11 // 10))


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------

ROWS: dict[str, dict] = {}


def row_of(case_id: str, case: Case, kernel: Kernel, seconds: float) -> dict:
    options, shape = case.describe()
    return dict(case=case_id, kernel=kernel.name.removeprefix("jaxkv_"), options=options,
                shape=shape, registers=kernel.registers, budget=register_budget(case_id),
                spills=f"{kernel.spill_stores}/{kernel.spill_loads}", smem=kernel.smem,
                grid="x".join(map(str, kernel.grid)), threads=kernel.threads[0],
                compile_s=seconds)


def markdown_table(rows) -> str:
    """The cases as a Markdown table (for BENCHMARKS.md): registers per thread (the budget) with
    the running jax, ptxas' spill bytes, the launch's dynamic shared memory, grid and threads,
    and the seconds of XLA's compile (Triton to PTX and XLA's own ptxas; lowering excluded)."""
    head = (f"| case | kernel | options | shape | registers (budget), jax {jax.__version__} "
            "| spill st/ld B | smem B | grid | threads | compile s |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['case']} | {r['kernel']} | {r['options']} | {r['shape']} | "
        f"{r['registers']} ({r['budget']}) | {r['spills']} | {r['smem']:,} | {r['grid']} | "
        f"{r['threads']} | {r['compile_s']:.1f} |\n" for r in rows)


@pytest.fixture(scope="module", autouse=True)
def _write_table():
    yield
    path = os.environ.get("JAXKV_GPU_COMPILE_TABLE")
    if path and ROWS:
        Path(path).write_text(markdown_table(ROWS[c] for c in CASES if c in ROWS))


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------

# Cases that do not pass today, with the evidence (xfail(strict=True): fixing one fails the run
# until it is moved back).
XFAIL: dict[str, str] = {}


KERNEL_NAMES = {"ragged": "jaxkv_ragged_paged_attention", "decode": "jaxkv_paged_decode_attention",
                "sparse": "jaxkv_sparse_paged_decode_attention"}   # their pallas_call names


def compile_case(case_id: str, case: Case, dump: Path, target: Path = H100):
    fn, args = case.call()
    kernels, seconds = compile_for(target, fn, args, dump)
    assert [k.name for k in kernels] == [KERNEL_NAMES[case.kernel]], [k.name for k in kernels]
    return kernels[0], seconds


@pytest.mark.parametrize("case_id", [
    pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=XFAIL[c])) if c in XFAIL else c
    for c in CASES])
def test_kernel_compiles_for_h100(case_id, tmp_path):
    case = CASES[case_id]
    kernel, seconds = compile_case(case_id, case, tmp_path)
    ROWS[case_id] = row_of(case_id, case, kernel, seconds)
    limit = smem_limit(H100)
    assert kernel.smem + kernel.static_smem <= limit
    assert kernel.threads == (32 * case.effective_config().num_warps, 1, 1)
    assert (kernel.spill_stores, kernel.spill_loads) == (0, 0), \
        f"{case_id} spills: {kernel.spill_stores} B stored, {kernel.spill_loads} B loaded"
    assert kernel.registers <= register_budget(case_id), \
        f"{case_id}: {kernel.registers} registers > budget {register_budget(case_id)}"


def test_h200_target_compiles_the_same_kernels(tmp_path):
    """The H200 (also sm_90a, same SMs and shared memory) gets the same PTX and launch as the
    H100: the H100 table stands for both."""
    for case_id in ("ragged-8b-mixed-32k-int4", "decode-8b-16-32k"):
        case = CASES[case_id]
        h100, _ = compile_case(case_id, case, tmp_path / f"{case_id}-h100", H100)
        h200, _ = compile_case(case_id, case, tmp_path / f"{case_id}-h200", H200)
        assert (h200.grid, h200.threads, h200.smem, h200.registers) == \
            (h100.grid, h100.threads, h100.smem, h100.registers)
        assert h200.ptx == h100.ptx


@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_oversized_tile_is_refused(kernel, tmp_path):
    """A kv tile far too large for shared memory fails the compile, naming the requested bytes
    and the target's opt-in limit."""
    config = (RaggedConfig(block_q=16, block_kv=256, num_warps=4, num_stages=4)
              if kernel == "ragged" else DecodeConfig(block_kv=1024, num_warps=4, num_stages=4))
    case = Case(kernel, LLAMA3_8B, context=32768, config=config, **MIXED)
    limit = smem_limit(H100)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match="RESOURCE_EXHAUSTED: Shared memory size limit exceeded") as e:
        compile_case("oversized", case, tmp_path)
    requested, available = map(int, re.search(r"requested (\d+), available: (\d+)",
                                              str(e.value)).groups())
    assert available == limit and requested > limit


def test_register_spill_is_caught(tmp_path):
    """The spill check has teeth: the int4 ragged kernel with 128-row q tiles (block_q 32 x
    group 4) needs more than 255 registers a thread, and ptxas' spill bytes say so."""
    case = Case("ragged", LLAMA3_8B, context=4096, kv="int4",
                config=RaggedConfig(block_q=32, block_kv=64), **MIXED)
    kernel, _ = compile_case("spill", case, tmp_path)
    assert kernel.registers == MAX_REGISTERS
    assert kernel.spill_stores > 0 and kernel.spill_loads > 0


if __name__ == "__main__":     # compile every case and print (or write) the table
    for cid, c in CASES.items():
        with tempfile.TemporaryDirectory() as d:
            k, s = compile_case(cid, c, Path(d))
        ROWS[cid] = row_of(cid, c, k, s)
        print(f"{cid}: {k.registers} registers, spills {k.spill_stores}/{k.spill_loads}, "
              f"smem {k.smem}, {s:.1f} s", file=sys.stderr, flush=True)
    table = markdown_table(ROWS.values())
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(table)
    print(table)


# --------------------------------------------------------------------------------------------
# the whole engine step
# --------------------------------------------------------------------------------------------


def engine_step_args(config, kv: str, tokens: int, seqs: int, context: int, kv_groups=None):
    """The jitted engine step of ``config`` on the Pallas path and its abstract arguments: params
    (bf16), a pool of ``kv`` holding ``seqs`` sequences of ``context`` positions (in every
    group of a hybrid cache's ``kv_groups``), a ragged step of ``tokens`` tokens over ``seqs``
    sequences, its sampling arrays and rng."""
    from jaxkv.kvcache.pages import abstract_cache
    from jaxkv.kvcache.spec import KVCacheSpec
    from jaxkv.model.llama import param_shapes
    from jaxkv.runner.step import DeviceStepInput, make_step
    from jaxkv.sample.sampler import SamplingTensors

    width = context // BLOCK_SIZE
    g = 1 if kv_groups is None else kv_groups.num_groups
    slots = config.num_layers if kv_groups is None else kv_groups.num_slots(config.num_layers)
    spec = KVCacheSpec(num_layers=slots, num_blocks=g * seqs * width + 1,
                       block_size=BLOCK_SIZE, num_kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, dtype="bfloat16", kv_cache_dtype=kv)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)   # noqa: E731
    inputs = DeviceStepInput(
        token_ids=i32(tokens), positions=i32(tokens), slot_mapping=i32(tokens),
        query_start_loc=i32(seqs + 1), seq_lens=i32(seqs), block_tables=i32(seqs, width),
        logits_indices=i32(seqs, 1), num_drafts=i32(seqs),
        sample_mask=jax.ShapeDtypeStruct((seqs,), jnp.bool_),
        group_slot_mapping=i32(g - 1, tokens), group_block_tables=i32(g - 1, seqs, width))
    sampling = SamplingTensors.from_params([], vocab_size=config.vocab_size, prompt_token_ids=[],
                                           output_token_ids=[], pad_to=seqs)
    sampling = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sampling)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    args = (param_shapes(config, jnp.bfloat16), abstract_cache(spec), inputs, sampling, rng)
    return make_step(config, attention_impl="pallas", kv_groups=kv_groups), args, spec


STEP_MODELS = {   # two layers of each: the kernels and fusions are per layer
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),   # the default
}


@pytest.mark.parametrize("model,kv,decode_only", [
    ("llama3-8b", "fp8_e4m3", False), ("llama3-8b", "int8", False), ("llama3-8b", "int4", False),
    ("smollm2-135m", "int8", False),
    ("llama3-8b", "fp8_e4m3", True), ("llama3-8b", "int8", True), ("llama3-8b", "int4", True),
    ("smollm2-135m", "int8", True)])
def test_engine_step_compiles_for_h100_and_reads_the_pool_in_place(model, kv, decode_only,
                                                                    tmp_path, monkeypatch):
    """The whole jitted step (model forward, Pallas attention, sampler) of the default model's
    and a Llama-3-8B's shapes (two layers each) compiles for an H100: a mixed step (256 tokens
    over 16 sequences) with the ragged kernel, and a decode-only step (16 sequences) with the
    split-K kernel at the engine's split count for the H100's 132 SMs. The
    quantized pool is read in place (no float array of the pool's shape anywhere in the
    program: no fusion dequantizes a copy), the donated pool is aliased to the output, and XLA's
    workspace stays within the memory planner's activation estimate."""
    from jaxkv.model.config import ModelConfig
    from jaxkv.runner.memory_plan import activation_bytes_estimate

    # the CPU kernels are chosen by JAX's default backend (the CPU here), not by the target
    monkeypatch.setenv("JAXKV_CPU_KERNELS", "0")
    config = ModelConfig(architecture="llama", num_layers=2, rms_norm_eps=1e-5,
                         rope_scaling=None, **STEP_MODELS[model])
    seqs, context = 16, 4096
    tokens = seqs if decode_only else 256
    step, args, spec = engine_step_args(config, kv, tokens, seqs, context=context)
    kernels, _, compiled = compile_for(H100, step, args, tmp_path, with_compiled=True,
                                       static={"num_logprobs": 0, "decode_only": decode_only})
    name = "jaxkv_paged_decode_attention" if decode_only else "jaxkv_ragged_paged_attention"
    assert [k.name for k in kernels] == [name] * config.num_layers
    if decode_only:
        splits = default_num_splits(seqs, config.num_kv_heads, context, DecodeConfig().block_kv,
                                    num_sms=132)
        assert splits > 1 and {k.grid for k in kernels} == {(seqs, config.num_kv_heads, splits)}
    for k in kernels:
        assert k.spill_stores == k.spill_loads == 0, k
    pool = f"{spec.num_blocks},{BLOCK_SIZE},{config.num_kv_heads},{config.head_dim}"
    hlo = compiled.as_text()
    assert not re.findall(rf"\b(?:f32|bf16|f16)\[{pool}\]", hlo), "a float copy of the pool"
    memory = compiled.memory_analysis()
    pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[1]))
    assert memory.alias_size_in_bytes >= pool_bytes, (memory.alias_size_in_bytes, pool_bytes)
    estimate = activation_bytes_estimate(config, dtype="bfloat16", kv_cache_dtype=kv,
                                         max_num_batched_tokens=tokens, max_num_seqs=seqs)
    assert memory.temp_size_in_bytes <= estimate, (memory.temp_size_in_bytes, estimate)


# --------------------------------------------------------------------------------------------
# the mixture of experts' grouped matmul (jaxkv/model/grouped_matmul.py)
# --------------------------------------------------------------------------------------------

MOE_SHAPES = {   # (rows A = tokens x top_k, K, N, experts X)
    "mixtral-8x7b-prefill-gate": (512, 4096, 14336, 8),
    "mixtral-8x7b-prefill-down": (512, 14336, 4096, 8),
    "mixtral-8x7b-decode8-gate": (16, 4096, 14336, 8),
    "qwen3-30b-a3b-decode64-gate": (512, 2048, 768, 128),
    "qwen3-30b-a3b-decode64-down": (512, 768, 2048, 128),
}


@pytest.mark.parametrize("case_id", list(MOE_SHAPES))
def test_grouped_matmul_compiles_for_h100(case_id, tmp_path):
    """The Pallas grouped matmul at Mixtral-8x7B and Qwen3-30B-A3B shapes (bf16): one launch
    of (row tiles + experts) x column tiles programs, within shared memory, no spills."""
    from jaxkv.model.grouped_matmul import grouped_matmul, rows_per_tile

    A, K, N, X = MOE_SHAPES[case_id]
    args = (jax.ShapeDtypeStruct((A, K), jnp.bfloat16), jax.ShapeDtypeStruct((X, K, N),
            jnp.bfloat16), jax.ShapeDtypeStruct((X,), jnp.int32))
    kernels, _ = compile_for(H100, functools.partial(grouped_matmul, impl="pallas"), args,
                             tmp_path)
    assert [k.name for k in kernels] == ["jaxkv_grouped_matmul"]
    k = kernels[0]
    assert k.grid[:2] == (-(-A // rows_per_tile(A, X)) + X, N // (128 if N % 128 == 0 else 64))
    assert k.smem + k.static_smem <= smem_limit(H100)
    assert (k.spill_stores, k.spill_loads) == (0, 0) and k.registers <= 128, k


def quantized_param_shapes(config, method: str, group: int) -> dict:
    """``param_shapes(config)`` in bf16 with the dense projections (and an MoE's experts) as
    abstract ``QuantizedWeight``s of ``method`` (what ``quantization=`` loads): [N, K] codes
    (a stack of experts [X, N, K]), f16 scales (and int4's minima), K the axes a projection
    contracts; ``"mxfp4"``: only the experts, with E8M0 scales (an MXFP4 checkpoint's)."""
    from jaxkv.model.llama import param_shapes
    from jaxkv.model.quantized import QuantizedWeight

    qtype = {"int8": "Q8_0", "fp8": "F8_E4M3", "int4": "Q4_1", "mxfp4": "MXFP4"}[method]

    def leaf(path, a):
        name = path[-1].key
        contracted = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1,
                      "up_proj": 1, "down_proj": 1}.get(name)
        if contracted is None:
            return a
        stack = a.shape[:1] if config.num_experts and path[-2].key == "mlp" else ()
        if method == "mxfp4" and not stack:
            return a
        shape = a.shape[len(stack):]
        K, N = math.prod(shape[:contracted]), math.prod(shape[contracted:])
        g = group if method in ("int4", "mxfp4") else K
        codes = {"Q8_0": (K, jnp.int8), "F8_E4M3": (K, jnp.float8_e4m3fn)}.get(
            qtype, (K // 2, jnp.uint8))
        d = jax.ShapeDtypeStruct((*stack, N, -(-K // g)),
                                 jnp.uint8 if method == "mxfp4" else jnp.float16)
        return QuantizedWeight(jax.ShapeDtypeStruct((*stack, N, codes[0]), codes[1]), d,
                               d if qtype == "Q4_1" else None, qtype, a.shape, g)

    return jax.tree_util.tree_map_with_path(leaf, param_shapes(config, jnp.bfloat16))


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantized_weights_engine_step_compiles_for_h100(method, tmp_path, monkeypatch):
    """A Llama-3-8B-shaped decode step (two layers) with weights quantized at load (int4 in
    groups of 128, fp8 per channel) compiled for an H100 traced as on a GPU: every dense
    projection is one ``quantized_matmul`` launch (q/k/v, o, gate/up, down: 7 a layer), no
    spills, and no bf16 copy of a weight anywhere in the program."""
    from jaxkv.model import linear
    from jaxkv.model.config import ModelConfig

    monkeypatch.setenv("JAXKV_CPU_KERNELS", "0")
    monkeypatch.setattr(linear, "on_gpu", lambda: True)     # the target's branch, traced here
    config = ModelConfig(architecture="llama", num_layers=2, rms_norm_eps=1e-5,
                         rope_scaling=None, **STEP_MODELS["llama3-8b"])
    step, args, _ = engine_step_args(config, "fp8_e4m3", 16, 16, context=4096)
    args = (quantized_param_shapes(config, method, 128), *args[1:])
    kernels, _, compiled = compile_for(H100, step, args, tmp_path, with_compiled=True,
                                       static={"num_logprobs": 0, "decode_only": True})
    hlo = compiled.as_text()
    names = [k.name.split("__")[0] for k in kernels]
    assert names.count("jaxkv_quantized_matmul") == 7 * config.num_layers, names
    assert names.count("jaxkv_paged_decode_attention") == config.num_layers, names
    for k in kernels:
        assert (k.spill_stores, k.spill_loads) == (0, 0), k
    for shape in ("bf16[4096,14336]", "bf16[14336,4096]", "bf16[4096,4096]"):
        assert shape not in hlo, shape


def test_moe_engine_step_compiles_for_h100_with_the_grouped_kernel(tmp_path, monkeypatch):
    """A Mixtral-shaped engine step (two layers, 8 experts, top 2) compiled deviceless for an
    H100 takes the Pallas grouped matmul (``lax.platform_dependent`` picks it for the target,
    not the CPU's tile loop): three launches a layer beside the attention, no spills."""
    from jaxkv.model.config import ModelConfig

    monkeypatch.setenv("JAXKV_CPU_KERNELS", "0")
    config = ModelConfig(architecture="mixtral", num_layers=2, rms_norm_eps=1e-5,
                         rope_scaling=None, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, **{**STEP_MODELS["llama3-8b"], "vocab_size": 32000})
    step, args, _ = engine_step_args(config, "fp8_e4m3", 256, 16, context=4096)
    kernels, _ = compile_for(H100, step, args, tmp_path, static={"num_logprobs": 0})
    names = [k.name.split("__")[0] for k in kernels]     # XLA suffixes a second variant
    assert names.count("jaxkv_grouped_matmul") == 3 * config.num_layers, names
    assert names.count("jaxkv_ragged_paged_attention") == config.num_layers, names
    for k in kernels:
        assert k.spill_stores == k.spill_loads == 0, k


def test_moe_engine_step_with_quantized_experts_compiles_for_h100(tmp_path, monkeypatch):
    """A Mixtral-shaped decode step (two layers, 8 experts of 4096 -> 14336) with int4 experts
    (groups of 128) compiled for an H100 traced as on a GPU: the grouped matmul's tile loop
    multiplies each tile by its expert with ``quantized_matmul`` (gate, up, down: 3 launches
    a layer beside the attention's 4 projections), no spills, and no bf16 copy of an expert."""
    from jaxkv.model import linear
    from jaxkv.model.config import ModelConfig

    monkeypatch.setenv("JAXKV_CPU_KERNELS", "0")
    monkeypatch.setattr(linear, "on_gpu", lambda: True)     # the target's branch, traced here
    config = ModelConfig(architecture="mixtral", num_layers=2, rms_norm_eps=1e-5,
                         rope_scaling=None, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, **{**STEP_MODELS["llama3-8b"], "vocab_size": 32000})
    step, args, _ = engine_step_args(config, "fp8_e4m3", 16, 16, context=4096)
    args = (quantized_param_shapes(config, "int4", 128), *args[1:])
    kernels, _, compiled = compile_for(H100, step, args, tmp_path, with_compiled=True,
                                       static={"num_logprobs": 0, "decode_only": True})
    hlo = compiled.as_text()
    names = [k.name.split("__")[0] for k in kernels]
    assert names.count("jaxkv_quantized_matmul") == 7 * config.num_layers, names
    assert "jaxkv_grouped_matmul" not in names
    for k in kernels:
        assert (k.spill_stores, k.spill_loads) == (0, 0), k
    for shape in ("bf16[4096,14336]", "bf16[14336,4096]", "bf16[8,4096,14336]"):
        assert shape not in hlo, shape


def gpt_oss_20b(num_layers: int = 2):
    """gpt-oss-20b's ``ModelConfig`` (a sliding layer with window 128, then a full one)."""
    from jaxkv.model.config import ModelConfig, RopeScaling

    return ModelConfig(
        architecture="gpt_oss", num_layers=num_layers, vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=150000.0, rope_scaling=RopeScaling(
            rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
            truncate=False), max_position_embeddings=131072, attention_bias=True,
        attention_sinks=True, num_experts=32, num_experts_per_tok=4, swiglu_limit=7.0,
        sliding_window=128, layer_types=("sliding_attention", "full_attention"))


def test_gpt_oss_hybrid_engine_step_compiles_for_h100(tmp_path, monkeypatch):
    """A gpt-oss-20b-shaped step (a sliding layer with window 128 and a full one, learned
    sinks, biases, 32 experts top 4 with the clamped SwiGLU, YaRN) over a hybrid cache (two
    groups overlaying one pool slot) compiles deviceless for an H100: each layer's ragged
    kernel (the sinks come from its lse) and three grouped matmuls, no spills."""
    from jaxkv.config.kv_groups import KVGroups

    monkeypatch.setenv("JAXKV_CPU_KERNELS", "0")
    config = gpt_oss_20b()
    groups = KVGroups.of_model(config)
    assert groups.windows == (None, 128) and groups.num_slots(2) == 1
    step, args, _ = engine_step_args(config, "bf16", 256, 16, context=4096, kv_groups=groups)
    kernels, _ = compile_for(H100, step, args, tmp_path, static={"num_logprobs": 0})
    names = [k.name.split("__")[0] for k in kernels]
    assert names.count("jaxkv_grouped_matmul") == 3 * config.num_layers, names
    assert names.count("jaxkv_ragged_paged_attention") == config.num_layers, names
    for k in kernels:
        assert k.spill_stores == k.spill_loads == 0, k


def test_gpt_oss_step_with_mxfp4_experts_compiles_for_h100(tmp_path, monkeypatch):
    """gpt-oss-20b's decode step with its experts kept MXFP4 as shipped (jaxkv/model/mxfp4.py)
    traced as on a GPU: each used tile of experts one ``quantized_matmul`` launch (gate, up,
    down: 3 a layer; the attention's projections bf16 dots), no spills, no bf16 copy of an
    expert stack."""
    from jaxkv.config.kv_groups import KVGroups
    from jaxkv.model import linear

    monkeypatch.setenv("JAXKV_CPU_KERNELS", "0")
    monkeypatch.setattr(linear, "on_gpu", lambda: True)     # the target's branch, traced here
    config = gpt_oss_20b()
    step, args, _ = engine_step_args(config, "bf16", 16, 16, context=4096,
                                     kv_groups=KVGroups.of_model(config))
    args = (quantized_param_shapes(config, "mxfp4", 32), *args[1:])
    kernels, _, compiled = compile_for(H100, step, args, tmp_path, with_compiled=True,
                                       static={"num_logprobs": 0, "decode_only": True})
    names = [k.name.split("__")[0] for k in kernels]
    assert names.count("jaxkv_quantized_matmul") == 3 * config.num_layers, names
    assert "jaxkv_grouped_matmul" not in names
    for k in kernels:
        assert (k.spill_stores, k.spill_loads) == (0, 0), k
    assert "bf16[32,2880,2880]" not in compiled.as_text()


# --------------------------------------------------------------------------------------------
# quantized weights (jaxkv/model/quantized_matmul.py)
# --------------------------------------------------------------------------------------------

QUANT_SHAPES = {   # (rows M, K, N): Llama-3-8B's gate/up and down at decode and prefill,
    # Gemma-3-4B's down at batch 1 (a projection GGUF's Q4_K_M stores as Q6_K)
    "gemma3-4b-decode1-down": (1, 10240, 2560),
    "llama3-8b-decode8-gate": (8, 4096, 14336),
    "llama3-8b-decode64-down": (64, 14336, 4096),
    "llama3-8b-prefill512-gate": (512, 4096, 14336),
}


QUANT_FORMATS = {   # (qtype, values per scale (0: per output channel), the scales' dtype)
    "Q8_0": ("Q8_0", 32, jnp.float16), "Q4_0": ("Q4_0", 32, jnp.float16),   # GGUF's blocks
    "Q4_1": ("Q4_1", 32, jnp.float16),
    "Q4_K": ("Q4_1", 32, jnp.float32), "Q6_K": ("Q8_0", 16, jnp.float32),  # GGUF's, repacked
    "int8": ("Q8_0", 0, jnp.float16), "fp8": ("F8_E4M3", 0, jnp.float16),   # made at load
    "int4-g128": ("Q4_1", 128, jnp.float16),
    "mxfp4": ("MXFP4", 32, jnp.uint8),                                      # gpt-oss's experts
}


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
@pytest.mark.parametrize("case_id", list(QUANT_SHAPES))
def test_quantized_matmul_compiles_for_h100(case_id, fmt, tmp_path):
    """The Pallas matmul over quantized weights (bf16 activations), GGUF's blocks (Q4_K
    repacked as Q4_1 with float32 scales and minima, Q6_K as Q8_0 codes in groups of 16 with
    float32 scales, jaxkv/model/quantized.py), MXFP4 (E8M0 scales) and the formats
    ``quantization=`` makes at load:
    one launch of row tiles x column tiles, within shared memory, no spills."""
    from jaxkv.model.quantized import QuantizedWeight
    from jaxkv.model.quantized_matmul import quantized_matmul

    M, K, N = QUANT_SHAPES[case_id]
    qtype, group, scale_dtype = QUANT_FORMATS[fmt]
    group = group or K
    codes = {"Q8_0": (K, jnp.int8), "F8_E4M3": (K, jnp.float8_e4m3fn)}.get(qtype,
                                                                           (K // 2, jnp.uint8))
    qs = jax.ShapeDtypeStruct((N, codes[0]), codes[1])
    scales = jax.ShapeDtypeStruct((N, -(-K // group)), scale_dtype)
    w = QuantizedWeight(qs, scales, scales if qtype == "Q4_1" else None, qtype, (N, K), group)
    kernels, _ = compile_for(H100, quantized_matmul, (jax.ShapeDtypeStruct((M, K), jnp.bfloat16),
                                                      w), tmp_path)
    assert [k.name for k in kernels] == ["jaxkv_quantized_matmul"]
    k = kernels[0]
    assert k.grid[:2] == (-(-M // min(32, max(16, M))), N // 128)
    assert k.smem + k.static_smem <= smem_limit(H100)
    assert (k.spill_stores, k.spill_loads) == (0, 0) and k.registers <= 128, k


# --------------------------------------------------------------------------------------------
# multi-head latent attention's decode kernel (jaxkv/attention/pallas/mla_decode.py)
# --------------------------------------------------------------------------------------------

MLA_LATENT = (512, 64)     # DeepSeek-V3's (and V2's) Lkv + R: 576-wide latents
MLA_CASES = {   # (query heads N, sequences S, context, pool dtype, heads a program); an fp8
    # pool (e4m3 codes, a bf16 scale per token; bf16 queries) is dequantized in the kernel
    "mla-v3-128h-1-32k": (128, 1, 32768, jnp.bfloat16, 16),     # V3 on one device: 128 heads
    "mla-v3-128h-32-4k": (128, 32, 4096, jnp.bfloat16, 16),
    "mla-v3-128h-32-4k-h64": (128, 32, 4096, jnp.bfloat16, 64),  # bench/gpu_check.py's (b5)
    "mla-v3-tp8-16h-1-32k": (16, 1, 32768, jnp.bfloat16, 16),   # TP-8: 16 heads a device
    "mla-v3-tp8-16h-128-4k": (16, 128, 4096, jnp.bfloat16, 16),
    "mla-v3-tp8-16h-8-4k-fp32": (16, 8, 4096, jnp.float32, 16),
    "mla-v3-128h-32-4k-fp8": (128, 32, 4096, jnp.float8_e4m3fn, 16),
    "mla-v3-tp8-16h-1-32k-fp8": (16, 1, 32768, jnp.float8_e4m3fn, 16),
}
# registers per thread when recorded (ptxas 12.9.86, sm_90a), by jax version, pool dtype and
# heads a program; the budget is that + 10% as REGISTERS', MAX_REGISTERS on a jax not recorded
MLA_REGISTERS = {"0.10.2": {(jnp.bfloat16, 16): 100, (jnp.bfloat16, 64): 223,
                            (jnp.float32, 16): 200, (jnp.float8_e4m3fn, 16): 204}}


@pytest.mark.parametrize("case_id", list(MLA_CASES))
def test_mla_decode_compiles_for_h100(case_id, tmp_path):
    """The absorbed MLA decode kernel at DeepSeek-V3's latent (512 + 64) over a 16-token paged
    pool: one launch of (sequences, head tiles, splits) programs with the default splits,
    within shared memory, no spills, registers within the recorded count + 10%."""
    from jaxkv.attention.pallas.mla_decode import MLADecodeConfig, mla_decode_attention
    from jaxkv.kvcache.pages import abstract_cache
    from jaxkv.kvcache.spec import KVCacheSpec

    N, S, context, dtype, block_h = MLA_CASES[case_id]
    (Lkv, R), max_blocks = MLA_LATENT, context // BLOCK_SIZE
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    pool_shape = (S * max_blocks + 1, BLOCK_SIZE, 1, Lkv + R)
    if dtype == jnp.float8_e4m3fn:
        pool = abstract_cache(KVCacheSpec(
            num_layers=1, num_blocks=pool_shape[0], block_size=BLOCK_SIZE, num_kv_heads=1,
            head_dim=Lkv + R, v_head_dim=0, dtype="bfloat16", kv_cache_dtype="fp8")).k[0]
        q_dtype = jnp.bfloat16
    else:
        pool, q_dtype = jax.ShapeDtypeStruct(pool_shape, dtype), dtype
    args = (jax.ShapeDtypeStruct((S, N, Lkv + R), q_dtype), pool, i32((S, max_blocks)),
            i32((S,)))
    config = MLADecodeConfig(block_h=block_h)
    fn = functools.partial(mla_decode_attention, kv_lora_rank=Lkv, sm_scale=0.135, config=config)
    kernels, _ = compile_for(H100, fn, args, tmp_path)
    assert [k.name for k in kernels] == ["jaxkv_mla_decode_attention"]
    k = kernels[0]
    tiles = N // config.block_h
    assert k.grid == (S, tiles, default_num_splits(S, tiles, context, config.block_kv)), k
    assert k.threads == (32 * config.num_warps, 1, 1)
    assert k.smem + k.static_smem <= smem_limit(H100)
    recorded = MLA_REGISTERS.get(jax.__version__, {}).get((dtype, block_h))
    budget = MAX_REGISTERS if recorded is None else min(MAX_REGISTERS, -(-recorded * 11 // 10))
    assert (k.spill_stores, k.spill_loads) == (0, 0) and k.registers <= budget, k


# DeepSeek-V3's attention and dense-layer shapes (its first 3 layers are dense; 2 of them here)
DEEPSEEK_V3_L2 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
    first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000,
    rope_scaling=dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
                      beta_slow=1, original_max_position_embeddings=4096))


@pytest.mark.parametrize("decode_only", [True, False])
def test_mla_deepseek_engine_step_compiles_for_h100(decode_only, tmp_path, monkeypatch):
    """The whole jitted step of DeepSeek-V3's shapes (two dense layers, 128 heads over a bf16
    latent pool of 16 sequences at 4K) on the Pallas path compiles for an H100: a decode-only
    step launches the MLA kernel once a layer at the engine's split count, without spills; a
    mixed step (256 tokens) takes the grouped XLA path, no Pallas attention kernel."""
    from jaxkv.attention.pallas.mla_decode import MLADecodeConfig
    from jaxkv.kvcache.pages import abstract_cache
    from jaxkv.model.config import ModelConfig

    monkeypatch.setenv("JAXKV_CPU_KERNELS", "0")     # the CPU kernels follow JAX's backend
    config = ModelConfig.from_hf_dict(DEEPSEEK_V3_L2)
    seqs, context = 16, 4096
    step, args, spec = engine_step_args(config, "auto", seqs if decode_only else 256, seqs,
                                        context=context)
    latent = dataclasses.replace(spec, v_head_dim=config.kv_cache_v_dim)     # 0: no V pool
    args = (args[0], abstract_cache(latent), *args[2:])
    kernels, _ = compile_for(H100, step, args, tmp_path,
                             static={"num_logprobs": 0, "decode_only": decode_only})
    attention = [k for k in kernels if "attention" in k.name]
    if not decode_only:
        assert attention == [], [k.name for k in attention]
        return
    assert [k.name for k in attention] == ["jaxkv_mla_decode_attention"] * config.num_layers
    c = MLADecodeConfig()
    tiles = config.num_heads // c.block_h
    splits = default_num_splits(seqs, tiles, context, c.block_kv, num_sms=132)
    assert {k.grid for k in attention} == {(seqs, tiles, splits)}
    assert all(k.spill_stores == k.spill_loads == 0 for k in attention), attention
