"""Native CPU kernels: C++ behind XLA's FFI, built on this machine on first use.

Design notes: docs/runtime.md."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_DIR = Path(__file__).parent
_SOURCES = (_DIR / "paged_attention.cc", _DIR / "row_stats.cc", _DIR / "matmul.cc",
            _DIR / "quant_matmul.cc")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17"]
_TARGETS = {"jaxkv_paged_rows": "JaxkvPagedRows", "jaxkv_paged_tiles": "JaxkvPagedTiles",
            "jaxkv_row_stats": "JaxkvRowStats", "jaxkv_matmul": "JaxkvMatmul",
            "jaxkv_quant_matmul": "JaxkvQuantMatmul"}

logger = logging.getLogger("jaxkv")

# Pool element types the kernels decode as they read a block (besides f32): 16-bit floats
# head-major like the f32 pools, 8-bit codes token-major with a scale per token and head.
HEAD_MAJOR_CODES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TOKEN_MAJOR_CODES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _cpu_signature() -> str:
    """The CPU model and feature flags (``-march=native`` builds for them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _library_path() -> Path:
    """Where this source's build for this machine lives."""
    texts = [p.read_text() for p in (*_SOURCES, _DIR / "common.h")]
    key = hashlib.sha256("\n".join([*texts, " ".join(_FLAGS), jax.__version__,
                                    platform.machine(), _cpu_signature()]).encode())
    root = Path(os.environ.get("JAXKV_CPU_KERNELS_DIR")
                or Path.home() / ".cache" / "jaxkv" / "cpu_kernels")
    return root / f"jaxkv_kernels-{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    """Compiles the sources into one library at ``path`` (atomically: concurrent builders each
    write their own temporary file and rename it)."""
    logger.info("building the native CPU kernels (g++ -O3 -march=native, once per machine "
                "and source: tens of seconds) into %s", path)
    t0 = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([os.environ.get("CXX", "g++"), *_FLAGS, "-isystem",
                        jax.ffi.include_dir(), *map(str, _SOURCES), "-o", tmp],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the native CPU kernels in %.1f s", time.perf_counter() - t0)


@functools.cache
def available() -> bool:
    """True when the kernels are built (building them now if needed) and registered with XLA;
    False with ``JAXKV_CPU_KERNELS=0`` or when the build fails (one warning says why)."""
    if os.environ.get("JAXKV_CPU_KERNELS", "1") == "0":
        return False
    path = _library_path()
    try:
        if not path.exists():
            _build(path)
        lib = ctypes.cdll.LoadLibrary(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"jaxkv: the native CPU kernels are unavailable, using the XLA paths "
                      f"({detail.strip()[-400:]})", RuntimeWarning, stacklevel=2)
        return False
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return True


def native() -> bool:
    """True when a step traced now should call the kernels: JAX's default backend (where the
    engine's step runs) is the CPU and the kernels are ``available()``. Decided at trace time:
    ``jax.lax.platform_dependent`` would trace the XLA branch as well, ~1.6 of the ~2.6 s it took
    to trace one step shape."""
    return jax.default_backend() == "cpu" and available()


def _require() -> None:
    """Builds and registers the kernels if needed; a RuntimeError if they are unavailable."""
    if not available():
        raise RuntimeError("jaxkv: the native CPU kernels are unavailable (JAXKV_CPU_KERNELS=0 "
                           "or their build failed; see the warning)")


def _pool_args(k: jax.Array, v: jax.Array, k_scale: jax.Array | None,
               v_scale: jax.Array | None, static_scale: float | None):
    """(pool operands k, k_scale, v, v_scale; pool attributes) of a kernel call over pools k, v
    (a scale the kernel ignores where the pool has none)."""
    if k.dtype != v.dtype:
        raise TypeError(f"k and v pools differ in dtype: {k.dtype} vs {v.dtype}")
    if k.dtype != jnp.float32 and k.dtype not in HEAD_MAJOR_CODES + TOKEN_MAJOR_CODES:
        raise TypeError(f"pool dtype {k.dtype} is not float32, bfloat16, float16, int8, "
                        "float8_e4m3fn or float8_e5m2")
    fixed = np.float32(static_scale or 0.0)
    if k.dtype in TOKEN_MAJOR_CODES and static_scale is None and (k_scale is None
                                                                  or v_scale is None):
        raise ValueError("int8/fp8 pools need k_scale and v_scale (or static_scale)")
    none = jnp.zeros((1,), jnp.bfloat16)                      # a scale the kernel ignores
    scales = [none if static_scale is not None or x is None else x.astype(jnp.bfloat16)
              for x in (k_scale, v_scale)]
    return (k, scales[0], v, scales[1]), dict(k_fixed_scale=fixed, v_fixed_scale=fixed)


def _mask_args(q: jax.Array, q_sinks: jax.Array | None, soft_cap: float | None,
               sliding_window: int | None, num_sinks: int):
    """(q, sink queries, logit attributes) of a kernel call: the sink queries are q itself
    unless StreamingLLM's rescoring applies (a window, sinks and ``q_sinks``)."""
    window = int(sliding_window or 0)
    sinks = int(num_sinks) if window else 0
    rescore = q_sinks is not None and sinks > 0
    q = q.astype(jnp.float32)
    return q, q_sinks.astype(jnp.float32) if rescore else q, dict(
        soft_cap=np.float32(soft_cap or 0.0), window=np.int64(window), num_sinks=np.int64(sinks),
        rescore=rescore)


def paged_rows(q: jax.Array, k: jax.Array, v: jax.Array, tables: jax.Array,
               row_pos: jax.Array, *, soft_cap: float | None = None,
               sliding_window: int | None = None, num_sinks: int = 0,
               q_sinks: jax.Array | None = None, k_scale: jax.Array | None = None,
               v_scale: jax.Array | None = None, static_scale: float | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Each sequence's row queries against its paged KV (the C++ kernel).

    Args:
      q: f32 [S, Hkv, R * G, D] row queries, already scaled; row r's head g at ``r * G + g``.
      k, v: one layer's pools: f32, bf16 or f16 head-major [N, Hkv, bs, D] (``HNDPages.data``),
        or int8 / float8_e4m3fn / float8_e5m2 codes token-major [N, bs, Hkv, D]
        (``QuantizedPages.data`` of an fp8/int8 cache).
      tables: int32 [S, W] physical block per logical block; 0 (the null block) is skipped.
      row_pos: int32 [S, R] kv position of each row query (it sees positions <= it); -1: none.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      sliding_window: a query at p sees only positions j with ``p - j < sliding_window``...
      num_sinks: ... or ``j < num_sinks`` (attention sinks; with a window only).
      q_sinks: f32 like q: the queries that score the sink positions (StreamingLLM's positions
        within the cache; with a window and sinks only); default q.
      k_scale, v_scale: bf16 [N, bs, Hkv, 1] the codes' scales (int8/fp8 pools).
      static_scale: instead of the scales, one fixed scale for both pools (fp8).

    Returns:
      (out f32 [S, Hkv, R * G, D], lse f32 [S, Hkv, R * G]): 0 and -inf for rows that see no
      position, as ``jaxkv.attention.reference.softmax_result``.
    """
    _require()
    S, Hkv, RG, D = q.shape
    pools, attrs = _pool_args(k, v, k_scale, v_scale, static_scale)
    q, qs, mask = _mask_args(q, q_sinks, soft_cap, sliding_window, num_sinks)
    call = jax.ffi.ffi_call("jaxkv_paged_rows",
                            (jax.ShapeDtypeStruct((S, Hkv, RG, D), jnp.float32),
                             jax.ShapeDtypeStruct((S, Hkv, RG), jnp.float32)))
    return call(q, qs, *pools, tables.astype(jnp.int32), row_pos.astype(jnp.int32), **mask,
                **attrs)


def paged_tiles(q: jax.Array, k: jax.Array, v: jax.Array, tables: jax.Array,
                query_start_loc: jax.Array, seq_lens: jax.Array, body: jax.Array, *,
                soft_cap: float | None = None, sliding_window: int | None = None,
                num_sinks: int = 0, q_sinks: jax.Array | None = None,
                k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                static_scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """The first ``body[s]`` query tokens of each sequence ``s``, causal over its paged KV (the
    C++ kernel; block size 16, head dim 64 or 128).

    Args:
      q: f32 [T, Hkv, G, D] every token's queries (the step's flat ragged layout), scaled.
      k, v: one layer's pools with blocks of 16 positions, as in ``paged_rows``.
      tables: int32 [S, W] physical block per logical block; 0 (the null block) is skipped.
      query_start_loc: int32 [S + 1] first token of each sequence in ``q``.
      seq_lens: int32 [S] kv length of each sequence: its last query token is at position
        ``seq_lens[s] - 1``, its first at ``seq_lens[s] - q_len``; each sees positions <= its own.
      body: int32 [S] how many of each sequence's leading tokens to compute (the rest are rows).
      soft_cap, sliding_window, num_sinks, q_sinks: as in ``paged_rows``.
      k_scale, v_scale, static_scale: as in ``paged_rows``.

    Returns:
      (out f32 [T, Hkv, G, D], lse f32 [T, Hkv, G]): 0 and -inf for tokens not computed here
      and for tokens that see no kept position.
    """
    _require()
    T, Hkv, G, D = q.shape
    pools, attrs = _pool_args(k, v, k_scale, v_scale, static_scale)
    q, qs, mask = _mask_args(q, q_sinks, soft_cap, sliding_window, num_sinks)
    call = jax.ffi.ffi_call("jaxkv_paged_tiles",
                            (jax.ShapeDtypeStruct((T, Hkv, G, D), jnp.float32),
                             jax.ShapeDtypeStruct((T, Hkv, G), jnp.float32)))
    return call(q, qs, *pools, *(x.astype(jnp.int32) for x in
                                 (tables, query_start_loc, seq_lens, body)), **mask, **attrs)


def matmul(x: jax.Array, w: jax.Array, *, transposed_w: bool = False) -> jax.Array:
    """``x @ w`` (the C++ kernel, for a few rows of x): ``matmuls(x, (w,), ...)[0]``.

    Args:
      x: f32 [M, K].
      w: f32 [K, N], or with ``transposed_w`` f32 [N, K] (e.g. an embedding used as the head).
      transposed_w: compute ``x @ w.T``.

    Returns:
      f32 [M, N].
    """
    return matmuls(x, (w,), transposed_w=transposed_w)[0]


def matmuls(x: jax.Array, ws, *, transposed_w: bool = False) -> tuple[jax.Array, ...]:
    """``x @ w`` for each weight of ``ws`` in one kernel call (a layer's q, k and v): the work
    items of every product share the threads, so the small ones cost no call of their own.

    Args:
      x: f32 [M, K].
      ws: a sequence of f32 [K, N_j] (with ``transposed_w``, f32 [N_j, K]).
      transposed_w: compute ``x @ w_j.T``.

    Returns:
      a tuple of f32 [M, N_j], one per weight.
    """
    _require()
    M, K = x.shape
    ws = tuple(ws)
    if not ws:
        raise ValueError("matmuls: ws is empty")
    for w in ws:
        if w.ndim != 2 or (w.shape[1] if transposed_w else w.shape[0]) != K:
            raise ValueError(f"matmul: x {x.shape} and w {w.shape} (transposed_w={transposed_w}) "
                             "do not contract")
    shapes = [jax.ShapeDtypeStruct((M, w.shape[0] if transposed_w else w.shape[1]), jnp.float32)
              for w in ws]
    call = jax.ffi.ffi_call("jaxkv_matmul", shapes)
    return tuple(call(x.astype(jnp.float32), *(w.astype(jnp.float32) for w in ws),
                      transposed_w=transposed_w))


# The quantized weights' code types the kernel reads (``jaxkv.model.quantized``), by its code.
QUANT_TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "F8_E4M3": 3, "MXFP4": 5}


def quant_matmuls(x: jax.Array, ws) -> tuple[jax.Array, ...]:
    """``x @ dequantize(w).T`` for each quantized weight of ``ws`` in one kernel call, the
    weights dequantized block by block in registers (any number of rows of x).

    Args:
      x: f32 [M, K], K a multiple of 32.
      ws: a sequence of ``jaxkv.model.quantized.QuantizedWeight`` of one qtype
        (``QUANT_TYPES``) and one group, each stored [N_j, K].

    Returns:
      a tuple of f32 [M, N_j], one per weight.
    """
    _require()
    M, K = x.shape
    ws = tuple(ws)
    if not ws or len({(w.qtype, w.group) for w in ws}) != 1 or ws[0].qtype not in QUANT_TYPES:
        raise ValueError(f"quant_matmuls: one qtype of {', '.join(QUANT_TYPES)} and one group "
                         f"for all weights, got {[(w.qtype, w.group) for w in ws]}")
    operands = []
    for w in ws:
        if w.cols != K:
            raise ValueError(f"quant_matmul: x {x.shape} and a weight of K={w.cols} do not "
                             "contract")
        operands += [w.qs, w.d, w.d if w.m is None else w.m]
    shapes = [jax.ShapeDtypeStruct((M, w.rows), jnp.float32) for w in ws]
    call = jax.ffi.ffi_call("jaxkv_quant_matmul", shapes)
    return tuple(call(x.astype(jnp.float32), *operands, qtype=np.int64(QUANT_TYPES[ws[0].qtype]),
                      group=np.int64(ws[0].group)))


def row_stats(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's first argmax, maximum and log-sum-exp (the C++ kernel).

    Args:
      x: f32 [S, V] logits.

    Returns:
      (first int32 [S], top f32 [S], log_norm f32 [S]): the first index of the row's maximum,
      the maximum, and ``log(sum(exp(x - top)))``, so ``x[j] - top - log_norm`` is token j's
      log-probability; for a row with a NaN (V - 1, NaN, NaN), and log_norm NaN for a row
      whose maximum is infinite.
    """
    _require()
    S, _ = x.shape
    call = jax.ffi.ffi_call("jaxkv_row_stats", (jax.ShapeDtypeStruct((S,), jnp.int32),
                                                jax.ShapeDtypeStruct((S,), jnp.float32),
                                                jax.ShapeDtypeStruct((S,), jnp.float32)))
    return call(x.astype(jnp.float32))
