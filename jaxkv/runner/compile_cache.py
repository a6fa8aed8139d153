"""JAX's persistent compilation cache, switched on for jaxkv so a second start skips XLA compiles.

Design notes: docs/runtime.md."""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV_VAR = "JAXKV_COMPILATION_CACHE_DIR"


def default_cache_dir() -> Path:
    """The directory used without an argument: the env var, else the user cache dir."""
    if env := os.environ.get(ENV_VAR):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "jaxkv" / f"jax-{jax.__version__}"


def enable_compilation_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """Turns on JAX's persistent compilation cache for this process; returns its directory.

    Idempotent: a second call with the same directory changes nothing. A call with a different
    directory switches the cache there: compilations from then on are looked up in and written
    to the new directory only. Executables this process has already compiled stay in its
    in-memory caches and are not copied to the new directory, so switching after JAX has
    compiled something leaves the new directory without those entries (a later process will
    compile them once and write them there).

    Args:
      cache_dir: the directory (created if missing); None picks ``default_cache_dir()``.

    Returns:
      The absolute directory the cache now reads and writes.
    """
    path = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).absolute()
    path.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir not in (None, str(path)):
        compilation_cache.reset_cache()   # JAX opens its cache directory once, on first use
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path
