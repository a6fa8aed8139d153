"""JAX's persistent compilation cache through jaxkv.runner.compile_cache: directory choice, idempotence,
and that CPU executables are written, read back by a second process, and follow a switch of dir.

What touches JAX's process-wide cache state runs in fresh interpreters, so this test process
keeps its own configuration.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax

from jaxkv.runner import compile_cache


def run_python(code: str, **env) -> dict:
    """Runs ``code`` in a fresh interpreter; the JSON it prints last."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


COUNT_HITS = """
    import json, jax, jax.numpy as jnp
    from jax import monitoring
    from jaxkv.runner.compile_cache import enable_compilation_cache
    hits = []
    monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
"""


def test_default_dir_env_var_and_argument(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_cache_dir() == tmp_path / "xdg" / "jaxkv" / f"jax-{jax.__version__}"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_cache_dir() == (tmp_path / "home" / ".cache" / "jaxkv"
                                                 / f"jax-{jax.__version__}")
    monkeypatch.setenv(compile_cache.ENV_VAR, "")                 # empty: unset
    assert compile_cache.default_cache_dir().parent == tmp_path / "home" / ".cache" / "jaxkv"
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.default_cache_dir() == tmp_path / "env"


def test_cpu_executables_are_written_then_read_by_a_second_process(tmp_path):
    code = COUNT_HITS + """
    path = enable_compilation_cache()
    assert enable_compilation_cache() == path              # same dir again: a no-op
    jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
    print(json.dumps(dict(dir=str(path), files=sorted(p.name for p in path.iterdir()),
                          hits=len(hits), min_time=jax.config.jax_persistent_cache_min_compile_time_secs)))
    """
    first = run_python(code, JAXKV_COMPILATION_CACHE_DIR=str(tmp_path / "c"))
    assert first["dir"] == str(tmp_path / "c") and first["min_time"] == 0.0
    assert any(f.startswith("jit_") and f.endswith("-cache") for f in first["files"])
    assert first["hits"] == 0
    second = run_python(code, JAXKV_COMPILATION_CACHE_DIR=str(tmp_path / "c"))
    assert second["files"] == first["files"] and second["hits"] >= 1


def test_switching_dir_after_a_compile_writes_later_compiles_to_the_new_dir(tmp_path):
    out = run_python(COUNT_HITS + f"""
    a = enable_compilation_cache({str(tmp_path / "a")!r})
    f = jax.jit(lambda x: x * 3.0)
    f(jnp.ones(8)).block_until_ready()
    b = enable_compilation_cache({str(tmp_path / "b")!r})
    jax.jit(lambda x: x - 7.0)(jnp.ones(8)).block_until_ready()
    f(jnp.ones(8)).block_until_ready()                     # already compiled: stays in memory
    print(json.dumps(dict(a=sorted(p.name for p in a.iterdir()),
                          b=sorted(p.name for p in b.iterdir()))))
    """)
    assert out["a"] and out["b"]
    assert not set(out["a"]) & set(out["b"])               # f's executable is not copied to b
    again = run_python(COUNT_HITS + f"""
    enable_compilation_cache({str(tmp_path / "b")!r})
    jax.jit(lambda x: x - 7.0)(jnp.ones(8)).block_until_ready()
    print(json.dumps(dict(hits=len(hits))))
    """)
    assert again["hits"] >= 1
