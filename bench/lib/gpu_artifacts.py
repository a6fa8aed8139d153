"""bench/gpu_check.py's executables: compiled (ahead of the run that needs them, in threads),
loaded from an archive, or compiled for a GPU that is not there and archived (``Executables``).

An archive is one zip file: ``manifest.json`` (the environment of the compile, a record per
executable) and one ``<key>.xla`` per executable, ``serialize_executable.serialize``'s payload
with its input and output trees, pickled. A key digests the executable's name (what it computes,
every static option included: ``describe``) with its arguments' tree, shapes and dtypes, so a
run finds an executable from the arguments it holds, without tracing anything.

What loading needs (``mismatch`` checks it from the manifest before anything is read): the jax,
jaxlib and jax CUDA plugin versions of the compile (a serialized XLA executable is not portable
across them), the same ``XLA_FLAGS``, the same sources (jaxkv's attention and KV-cache code and
gpu_check.py, hashed: a loaded kernel must be the tree's), and the same platform and GPU
generation: compute capability and SM count (or, where a device does not tell them, its kind).
A different device kind of the same generation (an H100 archive on an H200) loads and is
reported: the kernels' code is the same, XLA's fusion choices may differ. Anything else is
compiled, and the report says why. A deviceless compile does not autotune: the Pallas kernels
are fixed by their configs, but XLA's own dots (the references, Quest's page scores) take
default algorithms, so they may run slower than a device compile's.

A deviceless compile serializes (jax 0.10.2 with jax-cuda12-plugin, 0.11.2 with
jax-cuda13-plugin): the payload holds the kernels' cubin (an H100 decode loop: ~50 KB, ~42 KB
compressed), so the device runs no ptxas. It loads only on a backend of its platform: this CPU
refuses it ("INTERNAL: Failed to parse serialized CpuAotCompilationResult"), so a GPU archive's
load is first tried on the device; a failed load is compiled there instead.

Only load archives you made: unpickling one runs code.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import sys
import threading
import time
import zipfile
import zlib
from pathlib import Path

import jax
import numpy as np
from jax.experimental.serialize_executable import deserialize_and_load, serialize

FORMAT = 1
ROOT = Path(__file__).resolve().parents[2]
# the code a loaded executable must match: a changed kernel or check is compiled afresh
SOURCES = ("jaxkv/attention", "jaxkv/kvcache", "bench/gpu_check.py")
# a file that comes back from the device machine: 16 MiB at most
ARCHIVE_LIMIT = 15 << 20


# --------------------------------------------------------------------------------------------
# keys and environments
# --------------------------------------------------------------------------------------------


def describe(fn) -> str:
    """``module.name(static=...)`` of a function or a ``functools.partial`` of one (nested
    partials flattened); a closure's statics are not visible, so its caller names them. A
    script's functions are named by its file (``__main__`` when run, its name when imported)."""
    if isinstance(fn, functools.partial):
        args = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in sorted(fn.keywords.items())]
        return f"{describe(fn.func)}({', '.join(args)})"
    module = getattr(fn, "__module__", "?")
    if module == "__main__":
        module = Path(sys.modules["__main__"].__file__).stem
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def key(name: str, args) -> str:
    """Digest of ``name`` and the tree, shapes and dtypes of ``args`` (arrays or
    ShapeDtypeStructs alike)."""
    leaves, tree = jax.tree.flatten(args)
    lines = [name, str(tree)] + [f"{tuple(a.shape)} {np.dtype(a.dtype).name}" for a in leaves]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]


def sources_digest(root: Path = ROOT) -> str:
    """sha256 over the ``SOURCES`` files' paths and bytes."""
    h = hashlib.sha256()
    for top in SOURCES:
        path = root / top
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:24]


def plugin_versions() -> dict:
    """Versions of the installed jax CUDA plugins (jax-cuda12-plugin, jax-cuda13-pjrt, ...)."""
    names = {d.metadata["Name"].lower().replace("_", "-")
             for d in importlib.metadata.distributions() if d.metadata["Name"]}
    return {n: importlib.metadata.version(n) for n in sorted(names) if n.startswith("jax-cuda")}


def environment(device) -> dict:
    """What an executable compiled for (or run on) ``device`` depends on."""
    from jax._src.lib import version_str as jaxlib_version

    return dict(format=FORMAT, jax=jax.__version__, jaxlib=jaxlib_version,
                plugins=plugin_versions(), xla_flags=os.environ.get("XLA_FLAGS", ""),
                sources=sources_digest(), platform=device.platform,
                device_kind=device.device_kind,
                compute_capability=getattr(device, "compute_capability", None),
                core_count=getattr(device, "core_count", None))


def mismatch(manifest: dict, env: dict) -> str | None:
    """Why executables compiled in ``manifest``'s environment cannot load in ``env`` (None: they
    can)."""
    for field in ("format", "jax", "jaxlib", "plugins", "xla_flags", "sources", "platform"):
        if manifest.get(field) != env[field]:
            return f"{field}: archive {manifest.get(field)!r}, here {env[field]!r}"
    generation = ("compute_capability", "core_count")
    if all(manifest.get(f) is not None and env[f] is not None for f in generation):
        for field in generation:
            if manifest[field] != env[field]:
                return f"{field}: archive {manifest[field]!r}, here {env[field]!r}"
    elif manifest.get("device_kind") != env["device_kind"]:
        return f"device_kind: archive {manifest.get('device_kind')!r}, here {env['device_kind']!r}"
    return None


# --------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """Where executables are compiled: a one-device mesh (a deviceless CUDA device, or this
    process's first device), the sharding every argument gets, and the abstract mesh lowering
    runs under (jax > 0.10.2 asks it which GPU a Pallas kernel is for)."""

    name: str
    mesh: jax.sharding.Mesh
    abstract: bool                 # a compile-only device: executables cannot run here

    @property
    def device(self):
        return self.mesh.devices.flat[0]

    @property
    def sharding(self):
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def lowering(self):
        return (jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh) if self.abstract
                else contextlib.nullcontext())


def gpu_target(config: Path) -> Target:
    """The compile-only CUDA device of a ``GpuTargetConfigProto`` text file (tests/gpu_targets/).

    Needs the jax CUDA plugin (and ptxas, from the nvcc wheel) and backends started CPU-only
    (``JAX_PLATFORMS=cpu``): with the plugin and no GPU, an unset platform list lets the plugin
    fail to start, and it then offers no topology.
    """
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=config.read_text(),
                                        topology="1x1x1")
    return Target(config.stem, topologies.make_mesh(topo, (1,), ("x",)), abstract=True)


def local_target() -> Target:
    """This process's first device (the dry run's CPU)."""
    device = jax.devices()[0]
    return Target(device.platform, jax.sharding.Mesh(np.array([device]), ("x",)),
                  abstract=False)


# --------------------------------------------------------------------------------------------
# archives
# --------------------------------------------------------------------------------------------


class ArchiveWriter:
    """Serialized executables, compressed, collected in memory (thread-safe) and written as one
    zip by ``close``; an executable past ``limit`` bytes in all is left out and counted."""

    def __init__(self, path: Path, env: dict, limit: int = ARCHIVE_LIMIT):
        self.path, self.env, self.limit = Path(path), env, limit
        self.blobs: dict[str, bytes] = {}
        self.entries: dict[str, dict] = {}
        self.size = self.left_out = 0
        self._lock = threading.Lock()

    def add(self, key_: str, name: str, compiled, compile_s: float) -> bytes | None:
        """The compressed pickle of (payload, in tree, out tree), or None where it did not
        fit."""
        blob = zlib.compress(pickle.dumps(serialize(compiled)))
        with self._lock:
            if self.size + len(blob) > self.limit:
                self.left_out += 1
                return None
            self.size += len(blob)
            self.blobs[key_] = blob
            self.entries[key_] = dict(name=name, bytes=len(blob), compile_s=round(compile_s, 3))
        return blob

    def close(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        manifest = dict(self.env, created=time.strftime("%Y-%m-%d %H:%M:%S"),
                        left_out=self.left_out, executables=self.entries)
        with zipfile.ZipFile(self.path, "w") as z:
            z.writestr("manifest.json", json.dumps(manifest, indent=1))
            for k, blob in self.blobs.items():
                z.writestr(f"{k}.xla", blob)
        return self.path


def load_blob(blob: bytes):
    """A loaded ``jax.stages.Compiled`` from ``ArchiveWriter.add``'s bytes."""
    payload, in_tree, out_tree = pickle.loads(zlib.decompress(blob))
    return deserialize_and_load(payload, in_tree, out_tree)


class Archive:
    """A zip written by ``ArchiveWriter``, opened for reading."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.zip = zipfile.ZipFile(self.path)
        self.manifest = json.loads(self.zip.read("manifest.json"))
        self._lock = threading.Lock()          # loads come from several threads

    def __contains__(self, key_: str) -> bool:
        return key_ in self.manifest["executables"]

    def load(self, key_: str):
        with self._lock:
            blob = self.zip.read(f"{key_}.xla")
        return load_blob(blob)


def open_archives(paths, env: dict) -> tuple[list[Archive], list[str]]:
    """The archives among ``paths`` (zip files, or folders of them) that can load here, and one
    note per archive (what it is and why it is used or not)."""
    usable, notes = [], []
    for p in map(Path, paths):
        for zp in sorted(p.glob("*.zip")) if p.is_dir() else [p]:
            try:
                archive = Archive(zp)
            except (OSError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as e:
                notes.append(f"{zp}: unreadable ({type(e).__name__}: {e}): compiling instead")
                continue
            m = archive.manifest
            what = (f"{zp}: {len(m['executables'])} executables, jax {m.get('jax')}, "
                    f"{m.get('device_kind')}")
            reason = mismatch(m, env)
            if reason:
                notes.append(f"{what}: not used, {reason}: compiling instead")
            else:
                other = m["device_kind"] != env["device_kind"]
                notes.append(what + (f": used on {env['device_kind']} (same generation)"
                                     if other else ": used"))
                usable.append(archive)
    return usable, notes


# --------------------------------------------------------------------------------------------
# the executables of one run
# --------------------------------------------------------------------------------------------


def same_outputs(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


class Executables:
    """Every executable of a run, by key, got once by whichever asks first; one record each.

    * ``ahead(name, fn, specs)``, from a pass over the run with shapes only (``--prepare``, or a
      thread running ahead of a device run): lowered in the asking thread for ``target``, then
      compiled, or loaded where an archive holds it, in a pool of ``workers`` threads.
    * ``get(name, fn, args)``, from the run: waits for that executable (``wait_s``), or loads
      or compiles it on the spot. The first loaded executable of each section is also compiled,
      both are run on the same arguments and their outputs compared (``same_output``): compile
      vs load seconds on this device, and proof the load is sound. After a load fails, nothing
      more is loaded.
    * ``writer``: what is compiled is archived too; ``roundtrip`` (the dry run) uses the copy
      loaded back from the archived bytes, not the compiled executable.
    """

    def __init__(self, target: Target, *, archives=(), writer=None, roundtrip: bool = False,
                 workers: int = 1):
        self.target, self.archives, self.writer = target, list(archives), writer
        self.roundtrip = roundtrip
        self.records: list[dict] = []
        self.load_error: str | None = None
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._by_key: dict[str, dict] = {}
        self._sampled: set[str] = set()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)

    def _claim(self, name: str, args, section: str):
        """(the key's future, its record, whether this caller must fill the future)."""
        k = key(name, args)
        with self._lock:
            if k in self._futures:
                return self._futures[k], self._by_key[k], False
            future = self._futures[k] = concurrent.futures.Future()
            record = self._by_key[k] = dict(name=name, key=k, section=section)
            self.records.append(record)
        return future, record, True

    def _archive_for(self, k: str) -> Archive | None:
        if self.load_error is None:
            return next((a for a in self.archives if k in a), None)
        return None

    def ahead(self, name: str, fn, specs, section: str = "") -> None:
        """Starts getting the executable of ``jax.jit(fn)`` on arguments shaped like ``specs``."""
        future, record, mine = self._claim(name, specs, section)
        if not mine:
            return
        record["ahead"] = True
        archive = self._archive_for(record["key"])
        if archive is not None:
            self._pool.submit(_settle, future, self._load, record, archive)
            return
        try:
            t0 = time.perf_counter()
            specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=self.target.sharding), specs)
            with self.target.lowering():
                lowered = jax.jit(fn).lower(*specs)
            record["lower_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - recorded; the run, if any, tries again
            record.update(how="error", error=f"lower: {type(e).__name__}: {str(e)[:300]}")
            future.set_result(None)          # settled whatever happens: the run waits on it
            return
        self._pool.submit(_settle, future, self._compile, record, lowered)

    def get(self, name: str, fn, args, section: str = ""):
        """The executable of ``jax.jit(fn)`` on ``args``."""
        future, record, mine = self._claim(name, args, section)
        if mine:
            archive = self._archive_for(record["key"])
            _settle(future, *((self._load, record, archive) if archive is not None
                              else (self._lower_and_compile, record, fn, args)))
        t0 = time.perf_counter()
        exe = future.result()
        record["wait_s"] = record.get("wait_s", 0.0) + time.perf_counter() - t0
        if exe is None:                     # its lowering or load failed ahead: once more here
            exe = self._lower_and_compile(record, fn, args)
            with self._lock:
                self._futures[record["key"]] = _done(exe)
        if record.get("how") == "load" and section not in self._sampled:
            self._sampled.add(section)
            self._sample(record, exe, fn, args)
        return exe

    def _load(self, record: dict, archive: Archive):
        """The archived executable; None where loading fails (and nothing more is loaded)."""
        t0 = time.perf_counter()
        try:
            exe = archive.load(record["key"])
        except Exception as e:  # noqa: BLE001 - compiled instead
            self.load_error = f"{record['name']}: {type(e).__name__}: {str(e)[:300]}"
            record["load_error"] = self.load_error
            return None
        record.update(how="load", load_s=time.perf_counter() - t0, archive=archive.path.name)
        return exe

    def _sample(self, record: dict, exe, fn, args) -> None:
        try:
            t0 = time.perf_counter()
            compiled = jax.jit(fn).lower(*args).compile()
            compile_s = time.perf_counter() - t0
            record.update(same_output=same_outputs(exe(*args), compiled(*args)),
                          compile_s=compile_s)
        except Exception as e:  # noqa: BLE001 - the loaded one is used all the same
            record["sample_error"] = f"{type(e).__name__}: {str(e)[:300]}"

    def _lower_and_compile(self, record: dict, fn, args):
        t0 = time.perf_counter()
        try:
            lowered = jax.jit(fn).lower(*args)
        except Exception as e:
            record.update(how="error", error=f"lower: {type(e).__name__}: {str(e)[:300]}")
            raise
        record["lower_s"] = time.perf_counter() - t0
        return self._compile(record, lowered)

    def _compile(self, record: dict, lowered):
        """``lowered`` compiled (and archived); None for a compile-only target."""
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile()
        except Exception as e:
            record.update(how="error", error=f"compile: {type(e).__name__}: {str(e)[:300]}")
            raise
        record.update(how="compile", compile_s=time.perf_counter() - t0)
        blob = None
        if self.writer is not None:
            blob = self.writer.add(record["key"], record["name"], compiled, record["compile_s"])
            record["bytes"] = len(blob) if blob else None
        if self.target.abstract:
            return None
        if blob is None or not self.roundtrip:
            return compiled
        t0 = time.perf_counter()
        loaded = load_blob(blob)
        record.update(how="compile+load", load_s=time.perf_counter() - t0)
        return loaded

    def wait(self) -> None:
        """Blocks until every executable asked for so far is got."""
        with self._lock:
            futures = list(self._futures.values())
        concurrent.futures.wait(futures)

    def close(self) -> Path | None:
        """Waits for every executable under way; writes the archive (if any)."""
        self._pool.shutdown(wait=True)
        return self.writer.close() if self.writer is not None else None

    def summary(self) -> dict:
        """Counts and seconds by how each executable was got (compile, lower and load seconds
        summed over threads; wait = what the run spent blocked on them); the sampled
        compile-vs-load pairs and, from their means, the seconds loading saved."""
        out = {}
        for how in ("compile", "load", "compile+load", "error"):
            rs = [r for r in self.records if r.get("how") == how]
            if rs:
                out[how] = {f: round(sum(r.get(f, 0.0) for r in rs), 2)
                            for f in ("lower_s", "compile_s", "load_s", "wait_s")}
                out[how].update(count=len(rs), ahead=sum(bool(r.get("ahead")) for r in rs))
        inline = [r for r in self.records if r.get("how") in ("compile", "compile+load")
                  and not r.get("ahead")]
        out["inline"] = dict(count=len(inline), seconds=round(
            sum(r.get("lower_s", 0.0) + r.get("compile_s", 0.0) for r in inline), 2))
        pairs = [r for r in self.records if r.get("how") == "load" and "compile_s" in r]
        out["sampled"] = [dict(name=r["name"], section=r["section"], compile_s=r["compile_s"],
                               load_s=r["load_s"], same_output=r["same_output"]) for r in pairs]
        if pairs:
            gain = (np.mean([r["compile_s"] for r in pairs])
                    - np.mean([r["load_s"] for r in pairs]))
            out["saved_s_estimate"] = round(float(gain) * out["load"]["count"], 1)
        if self.load_error:
            out["load_error"] = self.load_error
        return out


def _settle(future: concurrent.futures.Future, fn, *args) -> None:
    try:
        future.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 - raised where the result is asked for
        future.set_exception(e)


def _done(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future
