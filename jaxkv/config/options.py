"""Options declared once: ``option(default, help, ...)`` makes a dataclass field whose type,
range and choices ``check_fields`` enforces and whose CLI flag ``EngineConfig.add_cli_args``
builds; plus the CLI parsers of sizes (``80GiB``) and of optional choices (``none``)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing

from jaxkv.config.checks import check_number, check_type

_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` / ``"1.5e9"`` / ``"512MB"`` -> bytes (a CLI flag parser)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 80GiB, 512MB or 1e9")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def parse_none(text: str) -> str | None:
    """``"none"`` (any case) -> None, else the text: the CLI parser of an optional choice."""
    return None if text.lower() == "none" else text


def option(default, help: str, *, choices=None, minimum=None, maximum=None, aliases=(),
           flags=(), parse=None, cli: bool = True):
    """A config field declared once: default, help, checks and its CLI flag.

    Args:
      default: the default value.
      help: one line for the docs and ``--help``.
      choices: allowed values (``None`` is allowed iff the annotation is optional).
      minimum, maximum: inclusive bounds of a number.
      aliases: other keyword names ``EngineConfig.from_kwargs`` accepts for it.
      flags: extra CLI flags (the main one is ``--`` + the name with dashes).
      parse: CLI string parser (default: from the annotation).
      cli: False for fields that are not command-line flags (e.g. a mesh object).
    """
    return dataclasses.field(default=default, metadata=dict(
        help=help, choices=choices, minimum=minimum, maximum=maximum, aliases=tuple(aliases),
        flags=tuple(flags), parse=parse, cli=cli))


def base_type(tp):
    """(type without ``| None``, whether None is allowed) of an annotation."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _checked(name: str, value, tp, meta) -> object:
    """``value`` as the field's type (ints as int, tuples as tuple), within its bounds."""
    tp, optional = base_type(tp)
    if value is None and optional:
        return None
    bounds = dict(low=meta.get("minimum"), high=meta.get("maximum"))
    if tp in (int, float):
        return check_number(name, value, tp, **bounds)
    if tp in (bool, str):
        return check_type(name, value, (tp,), f"a {tp.__name__}" + (" or None" if optional
                                                                      else ""))
    if typing.get_origin(tp) is tuple:
        check_type(name, value, (list, tuple), "a list or tuple" + (" or None" if optional
                                                                    else ""))
        return tuple(check_number(f"{name}[{i}]", v, typing.get_args(tp)[0], **bounds)
                     for i, v in enumerate(value))
    return value


def check_fields(obj) -> None:
    """Checks (and normalises) every ``option`` field of a frozen dataclass instance.

    Raises:
      TypeError: a value of the wrong type (a bool or float for an int, a str for a number...);
        a ``jaxkv.config.checks.ParamTypeError``.
      ValueError: a value out of its range or choices.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = _checked(f.name, getattr(obj, f.name), hints[f.name], f.metadata)
        object.__setattr__(obj, f.name, value)
        choices = f.metadata.get("choices")
        if value is not None and choices is not None and value not in choices:
            raise ValueError(f"{f.name}={value!r} is not one of: "
                             f"{', '.join(map(str, choices))}")
