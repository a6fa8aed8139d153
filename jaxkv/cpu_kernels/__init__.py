"""Native CPU kernels: C++ behind XLA's FFI, built on this machine on first use.

One kernel today, ``paged_rows`` (paged_rows.cc): the rows of the CPU attention path
(jaxkv/attention_grouped.py: each sequence's last R query tokens against its paged KV) over a
head-major float32 pool. XLA's own version of that loop gathers every chunk of K and V into a
fresh buffer and runs small batched dots on it; the kernel reads each block of K and V once,
in place, for all of a kv head's query rows.

Build: ``g++ -O3 -march=native`` against ``jax.ffi.include_dir()``, once per source,
compiler flags, jax version and CPU, into ``~/.cache/jaxkv/cpu_kernels`` (or
``$JAXKV_CPU_KERNELS_DIR``); a build that fails (no compiler) leaves the XLA path in place with
one warning. ``JAXKV_CPU_KERNELS=0`` switches the kernels off (the XLA path, e.g. to compare).
Only CPU lowering uses them (``jax.lax.platform_dependent``), so a step traced for a GPU never
contains the call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_SOURCE = Path(__file__).with_name("paged_rows.cc")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17"]
_TARGET = "jaxkv_paged_rows"


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
    key = hashlib.sha256("\n".join([_SOURCE.read_text(), " ".join(_FLAGS), jax.__version__,
                                    platform.machine(), _cpu_signature()]).encode())
    root = Path(os.environ.get("JAXKV_CPU_KERNELS_DIR")
                or Path.home() / ".cache" / "jaxkv" / "cpu_kernels")
    return root / f"paged_rows-{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    """Compiles paged_rows.cc to ``path`` (atomically: concurrent builders each write their own
    temporary file and rename it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([os.environ.get("CXX", "g++"), *_FLAGS, "-isystem",
                        jax.ffi.include_dir(), str(_SOURCE), "-o", tmp],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
        warnings.warn(f"jaxkv: the native CPU attention kernel is unavailable, using the XLA "
                      f"path ({detail.strip()[-400:]})", RuntimeWarning, stacklevel=2)
        return False
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.JaxkvPagedRows), platform="cpu")
    return True


def paged_rows(q: jax.Array, k: jax.Array, v: jax.Array, tables: jax.Array,
               row_pos: jax.Array, *, soft_cap: float | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Each sequence's row queries against its paged KV (the C++ kernel; ``available()`` first).

    Args:
      q: f32 [S, Hkv, R * G, D] row queries, already scaled; row r's head g at ``r * G + g``.
      k, v: f32 [N, Hkv, bs, D] one layer's head-major pools (``HNDPages.data``).
      tables: int32 [S, W] physical block per logical block; 0 (the null block) is skipped.
      row_pos: int32 [S, R] kv position of each row query (it sees positions <= it); -1: none.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.

    Returns:
      (out f32 [S, Hkv, R * G, D], lse f32 [S, Hkv, R * G]): 0 and -inf for rows that see no
      position, as ``jaxkv.attention.softmax_result``.
    """
    S, Hkv, RG, D = q.shape
    call = jax.ffi.ffi_call(_TARGET, (jax.ShapeDtypeStruct((S, Hkv, RG, D), jnp.float32),
                                      jax.ShapeDtypeStruct((S, Hkv, RG), jnp.float32)))
    return call(q.astype(jnp.float32), k, v, tables.astype(jnp.int32),
                row_pos.astype(jnp.int32), soft_cap=np.float32(soft_cap or 0.0))
