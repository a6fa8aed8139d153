"""Checks of user-given values, shared by requests and the engine config: each returns the value
in its plain Python type or raises naming the field (pure Python + numpy; no jax).

A wrong type raises ``ParamTypeError`` (a ``TypeError``, and a ``ValueError`` too, so callers
that report every rejected input by catching ``ValueError`` keep reporting it); a wrong value
raises ``ValueError``. Bools are never numbers; numpy scalars count as numbers; a real number
must be finite as a float32 (what the device computes with).
"""

from __future__ import annotations

import reprlib

import numpy as np

# What the request checks accept as a bool, an int and a real number (bools are neither number).
BOOLS = (bool, np.bool_)
_INTS = (int, np.integer)
_REALS = (int, float, np.integer, np.floating)
_F32_MAX = float(np.finfo(np.float32).max)


class ParamTypeError(TypeError, ValueError):
    """A request field of the wrong type.

    A ``TypeError``, and also a ``ValueError`` so that callers that report every rejected
    request by catching ``ValueError`` (the CLI, ``LLM.generate``) keep reporting this one.
    """


def check_type(name: str, value, types: tuple[type, ...], expected: str):
    """Returns ``value`` if it is an instance of ``types``; a bool only if ``bool`` is one of them.

    Raises:
      ParamTypeError: ``"<name>=<value> is not <expected>"``.
    """
    if not isinstance(value, types) or (isinstance(value, BOOLS) and bool not in types):
        raise ParamTypeError(f"{name}={reprlib.repr(value)} is not {expected}")
    return value


def check_number(name: str, value, kind: type = int, *, low=None, high=None,
                 low_open: bool = False, high_open: bool = False, optional: bool = False,
                 note: str = ""):
    """Returns ``value`` as a Python ``kind`` (``int`` or ``float``) inside the given range.

    An int is a Python or numpy integer; a float is any Python or numpy real number and must be
    finite as a float32 (what the sampler computes with). Bools are neither.

    Args:
      name: the field, named first in every error.
      value: what the caller passed.
      kind: ``int`` or ``float``.
      low, high: the bounds (None: unbounded), inclusive unless ``low_open`` / ``high_open``.
      optional: None is allowed (and returned).
      note: appended to the range error (e.g. what a bound stands for).

    Raises:
      ParamTypeError: not a number of ``kind``.
      ValueError: NaN, infinite, or outside the range.
    """
    if optional and value is None:
        return None
    expected = "an int" if kind is int else "a real number"
    check_type(name, value, _INTS if kind is int else _REALS,
               f"None or {expected}" if optional else expected)
    if kind is float and not abs(value) <= _F32_MAX:   # NaN, +-inf, or beyond float32
        raise ValueError(f"{name}={reprlib.repr(value)} is not finite (as a float32)")
    number = kind(value)
    if (low is not None and (number <= low if low_open else number < low)) or (
            high is not None and (number >= high if high_open else number > high)):
        if high is None:
            bounds = f"{'>' if low_open else '>='} {low}"
        elif low is None:
            bounds = f"{'<' if high_open else '<='} {high}"
        else:
            bounds = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name}={number!r} must be {bounds}{note}")
    return number


def check_token_ids(name: str, ids, vocab_size: int | None = None) -> list[int]:
    """Returns token ids as a list of Python ints, each ``>= 0`` (and ``< vocab_size`` if given).

    ``ids`` is a list or tuple of ints (Python or numpy; no bools, floats or strings) or a 1-D
    numpy integer array.

    Raises:
      ParamTypeError: another container, an element that is not an int, or a non-integer array.
      ValueError: an array that is not 1-D, or an id outside the range; element errors read
        ``"<name>=<ids>: <name>[<index>]=<id> ..."``.
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise ParamTypeError(f"{name} has dtype {ids.dtype}, not an integer dtype")
        if ids.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {ids.shape}")
        ids = ids.tolist()
    check_type(name, ids, (list, tuple), "a list or tuple of ints or a 1-D integer array")
    head = f"{name}={reprlib.repr(ids)}: {name}"
    note = "" if vocab_size is None else f" (vocab_size={vocab_size})"
    return [check_number(f"{head}[{i}]", t, int, low=0, high=vocab_size, high_open=True,
                         note=note) for i, t in enumerate(ids)]
