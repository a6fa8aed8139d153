"""Held-out Austen text for perplexity: the two novels jaxkv does not bundle (Persuasion,
Northanger Abbey), read from Debian's ``r-cran-janeaustenr`` without R.

On first use the package is fetched with ``apt-get download`` into ``$JAXKV_HELDOUT_DIR``
(default ``~/.cache/jaxkv/heldout``) and read in Python (the .deb's ``ar`` members, its
data.tar, the R lazy-load DB); each book's text is cached there as ``<book>.txt``.
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import struct
import subprocess
import tarfile
import zlib
from pathlib import Path

PACKAGE = "r-cran-janeaustenr"
BOOKS = ("persuasion", "northangerabbey")
DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"   # the lazy-load DB: .rdx index, .rdb


def cache_dir() -> Path:
    path = Path(os.environ.get("JAXKV_HELDOUT_DIR", Path.home() / ".cache" / "jaxkv" / "heldout"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def heldout_text(book: str = "persuasion") -> str:
    """The full text of ``book`` (``BOOKS``), its lines joined with "\\n" as jaxkv's bundled
    novels are (``jaxkv.data.austen``); downloaded, decoded and cached on first use."""
    if book not in BOOKS:
        raise ValueError(f"book={book!r}: choose one of {', '.join(BOOKS)}")
    path = cache_dir() / f"{book}.txt"
    if not path.is_file():
        rdx, rdb = _lazy_load_db(_download(cache_dir()))
        part = path.with_suffix(f".{os.getpid()}.part")          # concurrent first uses
        part.write_text("\n".join(_book_lines(rdx, rdb, book)), encoding="utf-8")
        part.replace(path)
    return path.read_text(encoding="utf-8")


def _download(directory: Path) -> Path:
    """The package's .deb in ``directory``, fetched with ``apt-get download`` if absent."""
    debs = sorted(directory.glob(f"{PACKAGE}_*.deb"))
    if debs:
        return debs[-1]
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"apt-get is not available: download Debian's {PACKAGE} .deb by hand "
                           f"into {directory} (or set JAXKV_HELDOUT_DIR to a folder holding it)")
    r = subprocess.run(["apt-get", "download", PACKAGE], cwd=directory, capture_output=True,
                       text=True)
    debs = sorted(directory.glob(f"{PACKAGE}_*.deb"))
    if r.returncode or not debs:
        raise RuntimeError(f"`apt-get download {PACKAGE}` failed (exit {r.returncode}); run "
                           f"`apt-get update` first?\n{r.stderr.strip()}")
    return debs[-1]


def _lazy_load_db(deb: Path) -> tuple[bytes, bytes]:
    """The .rdx and .rdb bytes inside the .deb (an ``ar`` archive holding data.tar.*)."""
    blob = deb.read_bytes()
    pos = 8                                           # after the "!<arch>\n" magic
    while pos < len(blob):                            # 60-byte member headers; data 2-aligned
        name, size = blob[pos:pos + 16].decode().strip(), int(blob[pos + 48:pos + 58])
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(blob[pos + 60:pos + 60 + size])) as tar:
                return tuple(tar.extractfile(f"./{DATA}{ext}").read() for ext in (".rdx", ".rdb"))
        pos += 60 + size + size % 2
    raise RuntimeError(f"{deb} has no data.tar member")


def _book_lines(rdx: bytes, rdb: bytes, book: str) -> list[str]:
    """One book's lines: the index (a gzip'd serialized list: ``variables`` maps each name to
    its blob's (offset, length) in the .rdb) locates a [4-byte length][zlib] blob."""
    index = unserialize(gzip.decompress(rdx))
    offset, length = index["variables"][book]
    return unserialize(zlib.decompress(rdb[offset + 4:offset + length]))


def unserialize(data: bytes):
    """A Python value of an R object serialized in XDR format (``serialize(x, NULL)``, version 2
    or 3), for the types a lazy-load DB of character vectors uses.

    The stream is ``X\\n``, then big-endian int32s: format version, writer's and minimal R
    versions (version 3: the native encoding's length and name). Each item starts with an int32
    of flags: type = flags & 0xFF, has-attributes = bit 9, has-tag = bit 10, and the CHARSXP
    encoding in the levels (flags >> 12: LATIN1 = 4, else UTF-8/ASCII). CHARSXP (9): length
    (-1: NA) and bytes -> str. STRSXP (16), VECSXP (19), INTSXP (13), LGLSXP (10), REALSXP (14):
    length and elements -> list, then attributes if flagged; a ``names`` attribute makes the
    list a dict. LISTSXP (2, pairlist): attributes, tag (a SYMSXP, 1, or a REFSXP, 255, to an
    earlier symbol), value, then the rest (the CDR) -> dict. NILVALUE (254) -> None.
    """
    if data[:2] != b"X\n":
        raise ValueError("not an XDR-serialized R object (expected the 'X\\n' header)")
    r = _XDR(data, 2)
    version = r.int()
    r.pos += 8                                        # writer's and minimal R versions
    if version == 3:
        r.pos += 4 + r.int()                          # the native encoding's name
    elif version != 2:
        raise ValueError(f"R serialization version {version} is not supported (2 or 3)")
    return r.item()


class _XDR:
    """A cursor over an XDR stream: big-endian ints and doubles, R items (``unserialize``)."""

    def __init__(self, data: bytes, pos: int):
        self.data, self.pos, self.symbols = data, pos, []

    def int(self) -> int:
        self.pos += 4
        return struct.unpack_from(">i", self.data, self.pos - 4)[0]

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:                               # NILVALUE_SXP
            return None
        if kind == 255:                               # REFSXP: an earlier symbol, 1-based
            return self.symbols[(flags >> 8 or self.int()) - 1]
        if kind == 1:                                 # SYMSXP: its CHARSXP name
            self.symbols.append(self.item())
            return self.symbols[-1]
        if kind == 9:                                 # CHARSXP
            n = self.int()
            if n < 0:                                 # NA_character_
                return None
            self.pos += n
            return self.data[self.pos - n:self.pos].decode("latin-1" if flags >> 12 & 4
                                                           else "utf-8")
        if kind == 2:                                 # LISTSXP: tagged pairs, as a dict
            return self._pairlist(has_attr, has_tag)
        if kind not in (10, 13, 14, 16, 19):
            raise ValueError(f"R SEXP type {kind} is not supported")
        n = self.int()
        if kind in (10, 13, 14):                      # LGLSXP, INTSXP, REALSXP
            fmt = f">{n}{'d' if kind == 14 else 'i'}"
            values = list(struct.unpack_from(fmt, self.data, self.pos))
            self.pos += struct.calcsize(fmt)
        else:                                         # STRSXP, VECSXP
            values = [self.item() for _ in range(n)]
        names = self.item().get("names") if has_attr else None
        return dict(zip(names, values)) if names is not None else values

    def _pairlist(self, has_attr: int, has_tag: int) -> dict:
        out = {}
        while True:
            if has_attr:
                self.item()
            tag = self.item() if has_tag else len(out)
            out[tag] = self.item()
            flags = self.int()                        # the CDR: another pair or NILVALUE
            if flags & 0xFF == 254:
                return out
            if flags & 0xFF != 2:
                raise ValueError(f"a pairlist ending in R SEXP type {flags & 0xFF}")
            has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
