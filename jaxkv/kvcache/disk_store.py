"""The persistent prefix cache: host-tier KV blocks as files a restarted engine hits.

Design notes: docs/kv-cache.md."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import sys
from pathlib import Path

import numpy as np

logger = logging.getLogger("jaxkv")

MAGIC = b"JAXKVBLK"
VERSION = 1
_HEADER = struct.Struct("<8sI32sqQ")   # magic, version, namespace, key, payload length
_DIGEST = 32


class KVCacheFileError(ValueError):
    """A persistent KV cache file that cannot be trusted as KV (named, with the reason)."""


def namespace(**fields) -> bytes:
    """The sha256 of what fixes a block's bytes (sorted ``fields``, the key hash algorithm and
    the file version): files are only ever read by an engine with the same one."""
    text = repr(sorted(fields.items())) + repr((sys.hash_info.algorithm, sys.hash_info.width,
                                                VERSION))
    return hashlib.sha256(text.encode()).digest()


def model_identity(path) -> tuple:
    """(resolved path, total bytes, newest mtime) of a model file or directory."""
    p = Path(path).resolve()
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    stats = [f.stat() for f in files]
    return (str(p), sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0))


def encode(ns: bytes, key: int, payload: np.ndarray) -> bytes:
    """A block file's bytes."""
    body = _HEADER.pack(MAGIC, VERSION, ns, key, payload.nbytes) + payload.tobytes()
    return body + hashlib.sha256(body).digest()


def decode(data: bytes, ns: bytes, key: int, block_bytes: int, name: str) -> np.ndarray:
    """The payload (uint8 [block_bytes]) of a block file's ``data``.

    Raises:
      KVCacheFileError: naming ``name`` and the first check that fails.
    """
    if len(data) < _HEADER.size + _DIGEST:
        raise KVCacheFileError(f"{name}: truncated ({len(data)} bytes, a header alone is "
                               f"{_HEADER.size + _DIGEST})")
    magic, version, file_ns, file_key, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise KVCacheFileError(f"{name}: not a jaxkv KV block file (magic {magic!r})")
    if version != VERSION:
        raise KVCacheFileError(f"{name}: file format version {version}, this jaxkv reads "
                               f"{VERSION}")
    if file_ns != ns:
        raise KVCacheFileError(f"{name}: written for another model / KV format (namespace "
                               f"{file_ns.hex()[:12]}, expected {ns.hex()[:12]})")
    if file_key != key:
        raise KVCacheFileError(f"{name}: holds key {file_key}, expected {key}")
    if length != block_bytes or len(data) != _HEADER.size + length + _DIGEST:
        raise KVCacheFileError(f"{name}: {len(data)} bytes with a {length}-byte payload; "
                               f"expected a {block_bytes}-byte payload (truncated?)")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise KVCacheFileError(f"{name}: checksum mismatch (corrupt)")
    return np.frombuffer(body, np.uint8, count=length, offset=_HEADER.size).copy()


class DiskKVStore:
    """Block files of one namespace under ``root``.

    Args:
      root: the ``kv_cache_dir``; created if missing.
      ns: ``namespace(...)`` of this engine.
      block_bytes: bytes of one block's unit row.
    """

    def __init__(self, root, ns: bytes, block_bytes: int):
        self.ns, self.block_bytes = ns, block_bytes
        self.dir = Path(root) / ns.hex()[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._keys = {int(p.stem) for p in self.dir.glob("*.kvb") if _is_int(p.stem)}
        self.num_written = self.num_loaded = self.num_refused = 0

    def path(self, key: int) -> Path:
        return self.dir / f"{key}.kvb"

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def store(self, key: int, row: np.ndarray) -> None:
        """Write ``row`` (uint8 [block_bytes]) under ``key`` unless a file holds it already."""
        if key in self._keys:
            return
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(encode(self.ns, key, np.ascontiguousarray(row, np.uint8)))
        os.replace(tmp, path)
        self._keys.add(key)
        self.num_written += 1

    def read(self, key: int) -> np.ndarray:
        """The verified row of ``key``'s file.

        Raises:
          KVCacheFileError: the file is missing, truncated, corrupt or foreign (named).
        """
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise KVCacheFileError(f"{path}: cannot be read ({e})") from None
        return decode(data, self.ns, key, self.block_bytes, str(path))

    def load(self, key: int) -> np.ndarray | None:
        """``read``, or None when there is no file for ``key`` or it is refused (logged, moved
        aside to ``*.corrupt``, counted in ``num_refused``)."""
        if key not in self._keys:
            return None
        try:
            row = self.read(key)
        except KVCacheFileError as e:
            logger.error("persistent KV cache: refused %s; the block will be recomputed", e)
            self._keys.discard(key)
            self.num_refused += 1
            try:
                os.replace(self.path(key), self.path(key).with_suffix(".corrupt"))
            except OSError:
                pass
            return None
        self.num_loaded += 1
        return row


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True
