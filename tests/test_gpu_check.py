"""bench/gpu_check.py's --quick selection and its executable archives (bench/lib/gpu_artifacts.py):
an archive whose manifest matches this process is loaded, one that does not is compiled, a load
that fails falls back to compiling. The full dry run is tests/test_pallas.py's
``test_gpu_check_dry_run``."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pickle
import sys
import zipfile
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_gpu_check():
    """bench/gpu_check.py as the module ``gpu_check`` (loaded once per process)."""
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


@pytest.fixture(scope="module")
def gpu_check():
    return load_gpu_check()


def affine(x, y, *, scale):
    return x * scale + y


def archive_one(A, path, env, shapes=((8,),)):
    """An archive of ``affine`` compiled here on each of ``shapes``; (its path, name, fn)."""
    fn = functools.partial(affine, scale=2.0)
    name = f"affine: {A.describe(fn)}"
    exes = A.Executables(A.local_target(), writer=A.ArchiveWriter(path, env))
    for shape in shapes:
        exes.get(name, fn, (jnp.ones(shape), jnp.ones(shape)))
    assert [r["how"] for r in exes.records] == ["compile"] * len(shapes)
    return exes.close(), name, fn


def test_an_archive_that_matches_is_loaded(gpu_check, tmp_path):
    A = gpu_check.artifacts
    env = A.environment(jax.devices()[0])
    path, name, fn = archive_one(A, tmp_path / "cpu.zip", env, shapes=((8,), (16,)))
    args = (jnp.arange(8.0), jnp.ones(8))
    manifest = json.loads(zipfile.ZipFile(path).read("manifest.json"))
    assert set(manifest["executables"]) == {A.key(name, (jnp.ones(n), jnp.ones(n)))
                                            for n in (8, 16)}
    assert (manifest["jax"], manifest["sources"]) == (jax.__version__, A.sources_digest())

    archives, notes = A.open_archives([tmp_path], env)       # a folder of zips
    assert len(archives) == 1 and notes[0].endswith(": used")
    exes = A.Executables(A.local_target(), archives=archives)
    exe = exes.get(name, fn, args, section="s")
    np.testing.assert_array_equal(exe(*args), np.arange(8.0) * 2 + 1)
    first = exes.records[0]
    # the first load of a section is compiled too, and both give the same output
    assert first["how"] == "load" and "compile_s" in first and first["same_output"]
    exes.get(name, fn, (jnp.ones(16), jnp.ones(16)), section="s")
    assert exes.records[1]["how"] == "load" and "compile_s" not in exes.records[1]
    assert exes.get(name, fn, args) is exe and len(exes.records) == 2     # kept by key
    exes.get(name, fn, (jnp.ones(4), jnp.ones(4)))                        # not archived
    exes.get("other: " + A.describe(fn), fn, args)                         # another name
    assert [r["how"] for r in exes.records[2:]] == ["compile", "compile"]
    summary = exes.summary()
    assert summary["load"]["count"] == 2 and summary["compile"]["count"] == 2
    assert [r["name"] for r in summary["sampled"]] == [name] and "saved_s_estimate" in summary


@pytest.mark.parametrize("field,value", [
    ("jax", "0.0.1"), ("jaxlib", "0.0.1"), ("plugins", {"jax-cuda13-plugin": "0.0.1"}),
    ("xla_flags", "--xla_gpu_autotune_level=0"), ("sources", "0" * 24), ("platform", "gpu"),
    ("format", 0)])
def test_an_archive_that_does_not_match_is_compiled(gpu_check, tmp_path, field, value):
    A = gpu_check.artifacts
    env = A.environment(jax.devices()[0])
    path, name, fn = archive_one(A, tmp_path / "cpu.zip", env)
    archives, notes = A.open_archives([path], dict(env, **{field: value}))
    assert archives == [] and notes[0].endswith("compiling instead")
    assert f"{field}: archive {env[field]!r}, here {value!r}" in notes[0]
    exes = A.Executables(A.local_target(), archives=archives)
    exes.get(name, fn, (jnp.ones(8), jnp.ones(8)))
    assert exes.records[0]["how"] == "compile"


def test_device_generation_decides_not_the_device_name(gpu_check):
    A = gpu_check.artifacts
    h100 = dict(A.environment(jax.devices()[0]), platform="gpu",
                device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0", core_count=132)
    assert A.mismatch(h100, dict(h100, device_kind="NVIDIA H200")) is None
    assert A.mismatch(h100, dict(h100, compute_capability="10.0")).startswith("compute_capab")
    assert A.mismatch(h100, dict(h100, core_count=114)).startswith("core_count")
    unknown = dict(h100, compute_capability=None)            # a device that does not tell
    assert A.mismatch(unknown, dict(unknown, device_kind="NVIDIA H200")).startswith("device_kind")
    assert A.mismatch(unknown, unknown) is None


def test_a_failed_load_compiles_and_stops_loading(gpu_check, tmp_path):
    A = gpu_check.artifacts
    env = A.environment(jax.devices()[0])
    path, name, fn = archive_one(A, tmp_path / "good.zip", env, shapes=((8,), (16,)))
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(bad, "w") as dst:
        for entry in src.namelist():           # every executable replaced by a pickled string
            dst.writestr(entry, src.read(entry) if entry == "manifest.json"
                         else zlib.compress(pickle.dumps("not an executable")))
    archives, _ = A.open_archives([bad], env)
    exes = A.Executables(A.local_target(), archives=archives)
    for n in (8, 16):
        exe = exes.get(name, fn, (jnp.ones(n), jnp.ones(n)))
        np.testing.assert_array_equal(exe(jnp.ones(n), jnp.ones(n)), np.full(n, 3.0))
    assert [r["how"] for r in exes.records] == ["compile", "compile"]
    assert "load_error" in exes.records[0] and "load_error" not in exes.records[1]
    assert exes.summary()["load_error"].startswith(name)


def test_ahead_from_shapes_is_what_the_run_gets_and_what_the_archive_loads(gpu_check, tmp_path):
    A = gpu_check.artifacts
    target = A.local_target()
    env = A.environment(target.device)
    fn = functools.partial(affine, scale=3.0)
    exes = A.Executables(target, writer=A.ArchiveWriter(tmp_path / "t.zip", env), workers=2)
    exes.ahead("affine", fn, (jax.ShapeDtypeStruct((4,), jnp.float32),) * 2)   # shapes only
    args = (jnp.arange(4.0), jnp.ones(4))
    exe = exes.get("affine", fn, args)
    np.testing.assert_array_equal(exe(*args), np.arange(4.0) * 3 + 1)
    path = exes.close()
    [record] = exes.records                                   # compiled once, ahead
    assert record["how"] == "compile" and record["ahead"] and "wait_s" in record
    assert record["bytes"] > 0 and exes.summary()["inline"]["count"] == 0
    archives, _ = A.open_archives([path], env)
    loaded = A.Executables(target, archives=archives)
    loaded.ahead("affine", fn, args)                          # loaded ahead, no lowering
    np.testing.assert_array_equal(loaded.get("affine", fn, args)(*args), np.arange(4.0) * 3 + 1)
    assert loaded.records[0]["how"] == "load" and "lower_s" not in loaded.records[0]


def test_an_archive_past_its_limit_leaves_executables_out(gpu_check, tmp_path):
    A = gpu_check.artifacts
    env = A.environment(jax.devices()[0])
    writer = A.ArchiveWriter(tmp_path / "small.zip", env, limit=1)
    exes = A.Executables(A.local_target(), writer=writer, roundtrip=True)
    fn = functools.partial(affine, scale=2.0)
    exe = exes.get("affine", fn, (jnp.ones(4), jnp.ones(4)))
    np.testing.assert_array_equal(exe(jnp.ones(4), jnp.ones(4)), np.full(4, 3.0))
    exes.close()
    assert writer.left_out == 1 and exes.records[0]["how"] == "compile"    # not loaded back
    manifest = json.loads(zipfile.ZipFile(tmp_path / "small.zip").read("manifest.json"))
    assert manifest["executables"] == {} and manifest["left_out"] == 1


class KeyRecorder:
    """Stands in for ``Executables`` in an abstract pass: records the keys it is asked for."""

    def __init__(self, A):
        self.key, self.keys = A.key, {}

    def ahead(self, name, fn, specs, section=""):
        self.keys[self.key(name, specs)] = section


def planned_keys(gpu_check, settings) -> dict:
    """key -> section of every executable a run of ``settings`` asks for (shapes only)."""
    recorder = KeyRecorder(gpu_check.artifacts)
    run = gpu_check.Run(settings, recorder, abstract=True)
    gpu_check.run_sections(run, dict(sections_s={}), [n for n in settings.sections
                                                     if n in gpu_check.PREPARED], None)
    assert not run.errors
    return recorder.keys


def test_the_full_run_prepares_every_executable_of_the_quick_run(gpu_check):
    """--prepare of the full run covers --quick, at real sizes (shapes only, nothing compiled;
    the dry run's sizes: ``test_quick_dry_run_loads_what_prepare_compiled``); --quick keeps one
    end-to-end row."""
    full, quick = gpu_check.FULL, gpu_check.QUICK
    full_keys, quick_keys = planned_keys(gpu_check, full), planned_keys(gpu_check, quick)
    assert set(quick_keys) < set(full_keys)
    assert (len(full_keys), len(quick_keys)) == (435, 62)          # the docstring's estimate
    assert set(quick_keys.values()) == {"copy_gbps", "correctness", "decode", "prefill"}
    largest = max(full.e2e_models[0].runs[0][1])
    assert [m.runs for m in quick.e2e_models] == [(("auto", (largest,)),)]


@pytest.mark.slow
def test_quick_dry_run_loads_what_prepare_compiled(gpu_check, tmp_path):
    """--prepare (here: for this CPU) then --quick --artifacts: the prepared executables are
    exactly the run's, every one is loaded, and --quick runs its selection only."""
    prep, out = tmp_path / "prep", tmp_path / "out"
    assert gpu_check.main(["--dry-run", "--quick", "--prepare", str(prep)]) == 0
    manifest = json.loads(zipfile.ZipFile(prep / "cpu.zip").read("manifest.json"))
    assert gpu_check.main(["--dry-run", "--quick", "--artifacts", str(prep),
                           "--out", str(out)]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    executables = report["executables"]
    assert {r["key"] for r in executables} == set(manifest["executables"])
    assert all(r["how"] == "load" for r in executables)
    sampled = report["artifacts"]["summary"]["sampled"]
    assert [r["section"] for r in sampled] == ["copy_gbps", "correctness", "decode", "prefill"]
    assert all(r["same_output"] for r in sampled)
    # --quick's selection
    assert list(report["sections_s"]) == ["copy_gbps", "correctness", "decode", "prefill", "e2e"]
    ours = report["correctness"]["ours"]
    want = {(p, k, v) for p, vs, ks in gpu_check.QUICK_POOLS for v in vs for k in ks
            if not (k == "sparse" and v == "window+sinks")}
    assert {(r["pool"], r["kernel"], r["variant"]) for r in ours} == want
    assert len(ours) == len(want) == 22 and all(r["ok"] for r in ours)
    assert [(r["batch"], r["context"]) for r in report["decode"]] == [(2, 64)] * 3
    assert [r.get("kv_cache_dtype") for r in report["decode"]] == [None, "fp8_e4m3", "int4"]
    assert len(report["prefill"]) == 2 and all(r["tflops"] > 0 for r in report["prefill"])
    [e2e] = report["e2e"]
    assert e2e["ok"] and (e2e["batch"], e2e["kv_cache_dtype"]) == (4, "bf16")
    assert not report["sparse"] + report["kept"] + report["offload"] + report["sweep"]
    md = (out / "gpu_check.md").read_text()
    assert "## (f) end to end" in md and "## (b3)" not in md and "loading saved" in md


@pytest.mark.gpu_compile
def test_prepare_for_an_h100_archives_its_cubin(gpu_check, tmp_path):
    """Deviceless: a split-K decode compiled for an H100 serializes, its payload holds the
    kernel's cubin (the device runs no ptxas), and this CPU does not take the archive. Needs the
    jax CUDA plugin and JAX_PLATFORMS=cpu (.ci/gpu_compile.sh's venv, or jax 0.11.2's with
    jax-cuda13-plugin: bench/README.md)."""
    if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
        pytest.skip("no jax CUDA plugin: the deviceless compile needs it")
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        pytest.skip("run with JAX_PLATFORMS=cpu: with the plugin and no GPU, JAX offers no "
                    "CUDA topology otherwise")
    from jaxkv.attention.pallas import paged_decode_attention

    A = gpu_check.artifacts
    target = A.gpu_target(gpu_check.TARGETS / "h100_sxm.txtpb")
    env = A.environment(target.device)
    assert (env["platform"], env["device_kind"], env["compute_capability"], env["core_count"]) \
        == ("gpu", "NVIDIA H100 80GB HBM3", "9.0", 132)
    exes = A.Executables(target, writer=A.ArchiveWriter(tmp_path / "h100.zip", env))
    sds = jax.ShapeDtypeStruct
    specs = (sds((8, 32, 128), jnp.bfloat16), sds((1025, 16, 8, 128), jnp.bfloat16),
             sds((1025, 16, 8, 128), jnp.bfloat16), sds((8, 128), jnp.int32),
             sds((8,), jnp.int32))
    exes.ahead("decode", paged_decode_attention, specs)
    path = exes.close()
    [record] = exes.records
    assert record["how"] == "compile" and record["bytes"] > 0
    blob = zipfile.ZipFile(path).read(f"{record['key']}.xla")
    payload, _, _ = pickle.loads(zlib.decompress(blob))
    assert b"\x7fELF" in payload
    archives, notes = A.open_archives([path], A.environment(jax.devices()[0]))
    assert archives == [] and "platform: archive 'gpu', here 'cpu'" in notes[0]
