"""Public-domain text that ships with jaxkv: four Jane Austen novels (Project Gutenberg's text,
as packaged by Debian's r-cran-janeaustenr), gzip-compressed.

They are the default corpus of ``jaxkv bench`` and ``jaxkv eval ppl`` and the text the tests,
benchmarks and notebooks use, so every one of them runs from any clone or install, offline.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
BOOKS = ("emma", "mansfield_park", "pride_and_prejudice", "sense_and_sensibility")
PREFIX = "austen:"   # a text spec naming a bundled book: "austen:emma"


@functools.cache
def austen(book: str = "emma") -> str:
    """The full text of one bundled novel (``BOOKS``; a trailing ``.txt`` is accepted)."""
    name = book.removesuffix(".txt")
    if name not in BOOKS:
        raise ValueError(f"book={book!r} is not bundled; choose one of {', '.join(BOOKS)}")
    with gzip.open(DATA_DIR / f"{name}.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()


def read_text(spec: str) -> str:
    """The text of ``spec``: ``"austen:BOOK"`` (a bundled novel) or a path to a UTF-8 file.

    Raises:
      ValueError: an unknown bundled book, or a path that is not a readable file.
    """
    if spec.startswith(PREFIX):
        return austen(spec[len(PREFIX):])
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"{spec!r} is neither a file nor a bundled text "
                         f"({', '.join(PREFIX + b for b in BOOKS)})")
    return path.read_text(encoding="utf-8")
