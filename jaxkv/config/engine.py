"""``EngineConfig``: the user's arguments in their groups, built from the flat keyword arguments
of ``LLM(...)`` (``from_kwargs``, aliases included) or from command-line flags
(``add_cli_args`` / ``from_cli``), every error naming the argument as the user gave it."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import typing

from jaxkv.config.args import (CacheArgs, KVEventsArgs, ModelArgs, OffloadArgs, ParallelArgs,
                               RetentionArgs, RuntimeArgs, SparseAttentionArgs, SpeculativeArgs)
from jaxkv.config.options import base_type, parse_none
from jaxkv.config.scheduler import SchedulerConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything a user chooses about an engine, grouped (see the module docstring)."""

    model: ModelArgs = dataclasses.field(default_factory=ModelArgs)
    cache: CacheArgs = dataclasses.field(default_factory=CacheArgs)
    retention: RetentionArgs = dataclasses.field(default_factory=RetentionArgs)
    sparse: SparseAttentionArgs = dataclasses.field(default_factory=SparseAttentionArgs)
    offload: OffloadArgs = dataclasses.field(default_factory=OffloadArgs)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelArgs = dataclasses.field(default_factory=ParallelArgs)
    runtime: RuntimeArgs = dataclasses.field(default_factory=RuntimeArgs)
    speculative: SpeculativeArgs = dataclasses.field(default_factory=SpeculativeArgs)
    kv_events: KVEventsArgs = dataclasses.field(default_factory=KVEventsArgs)

    def __post_init__(self):
        if self.kv_events.enabled and self.cache.prefix_caching is None:
            raise ValueError("kv_events_config.enable_kv_cache_events=True needs prefix_caching "
                             "(the events describe the prefix cache's blocks)")
        if self.sparse.sparse_attention is not None and self.retention.kv_retention != "full":
            raise ValueError(f"sparse_attention={self.sparse.sparse_attention!r} does not "
                             f"compose with kv_retention={self.retention.kv_retention!r} (its "
                             f"selection and sparse kernels know no window); use "
                             f"kv_retention='full'")

    @classmethod
    def groups(cls) -> dict[str, type]:
        """Group name -> its dataclass, in declaration order."""
        return {f.name: f.default_factory for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """The config of flat keyword arguments (``LLM(model=..., max_num_seqs=...)``).

        Raises:
          TypeError: an unknown argument (with the closest names), an argument given twice
            (under a name and an alias), or a value of the wrong type.
          ValueError: a value out of range, naming the argument as given (its alias, if the
            value came under one).
        """
        return cls._of(kwargs, {})

    @classmethod
    def _of(cls, kwargs: dict, labels: dict[str, str]) -> "EngineConfig":
        """``from_kwargs``, where an error names a value ``labels[key]`` (a CLI flag) or the
        keyword it came under."""
        names = _argument_names()
        grouped: dict[str, dict] = {g: {} for g in cls.groups()}
        given: dict[str, str] = {}   # field -> what the user called it
        for key, value in kwargs.items():
            if key not in names:
                close = difflib.get_close_matches(key, names, n=3)
                raise TypeError(f"unknown engine argument {key!r}"
                                + (f"; did you mean {', '.join(close)}?" if close else ""))
            group, field = names[key]
            if field in grouped[group]:
                raise TypeError(f"engine argument {field!r} given twice (as {key!r})")
            grouped[group][field] = value
            given[field] = labels.get(key, key)
        try:
            return cls(**{g: t(**grouped[g]) for g, t in cls.groups().items()})
        except (TypeError, ValueError) as e:
            e.args = (_as_given(str(e), given),)
            raise

    def to_kwargs(self) -> dict:
        """The flat keyword arguments that rebuild this config (``from_kwargs`` inverse)."""
        return {f.name: getattr(getattr(self, g), f.name)
                for g, t in self.groups().items() for f in dataclasses.fields(t)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, **defaults) -> None:
        """Adds one flag per field, grouped; ``defaults`` overrides a field's default."""
        for group, t in cls.groups().items():
            g = parser.add_argument_group(f"engine: {group}", _summary(t))
            hints = typing.get_type_hints(t)
            for f in dataclasses.fields(t):
                if not f.metadata.get("cli", True):
                    continue
                meta, (tp, _) = f.metadata, base_type(hints[f.name])
                flags = ["--" + f.name.replace("_", "-"), *meta["flags"]]
                kw = dict(dest=f.name, default=defaults.get(f.name, f.default), help=meta["help"])
                if tp is bool:
                    kw["action"] = argparse.BooleanOptionalAction
                elif typing.get_origin(tp) is tuple:
                    kw.update(action=_TypedFlag, nargs="+", type=int)
                else:
                    kw.update(action=_TypedFlag, type=meta["parse"] or tp, metavar=_metavar(meta))
                g.add_argument(*flags, **kw)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> "EngineConfig":
        """The config of parsed ``add_cli_args`` flags (other attributes are ignored); an
        error names the flag as typed (``--num-kv-blocks=1 must be >= 2``)."""
        names = {field for key, (_, field) in _argument_names().items() if key == field}
        return cls._of({k: v for k, v in vars(namespace).items() if k in names},
                       vars(namespace).get(_TypedFlag.RECORD, {}))


class _TypedFlag(argparse.Action):
    """Stores a flag's value and which of its spellings was typed, for ``from_cli``'s errors."""

    RECORD = "_typed_engine_flags"   # namespace attribute: field -> the flag typed

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        vars(namespace).setdefault(self.RECORD, {})[self.dest] = option_string


def _metavar(meta) -> str | None:
    """``{a,b,c}`` of a field with choices (and ``none`` where the flag parses it), else None
    (argparse's default)."""
    if meta["choices"] is None:
        return None
    none = ("none",) if meta["parse"] is parse_none else ()
    return "{" + ",".join(map(str, (*meta["choices"], *none))) + "}"


def _as_given(text: str, given: dict[str, str]) -> str:
    """An error ``text`` with each ``field=value`` (or ``field[i]=value``) named as the user
    gave it (an alias or a flag)."""
    for field, name in given.items():
        if name != field:
            text = re.sub(rf"\b{field}(?=[=\[])", name, text)
    return text


def _summary(t: type) -> str:
    """The first line of a class's docstring."""
    return t.__doc__.strip().splitlines()[0]


def describe_arguments(indent: int = 0) -> str:
    """One line per engine argument (``name (default): help``), by group, for docstrings."""
    pad = " " * indent
    lines = []
    for group, t in EngineConfig.groups().items():
        lines.append(f"{pad}{group}: {_summary(t)}")
        for f in dataclasses.fields(t):
            aliases = f.metadata.get("aliases", ())
            also = f"; also {', '.join(aliases)}" if aliases else ""
            lines.append(f"{pad}  {f.name} (default {f.default!r}{also}): {f.metadata['help']}")
    return "\n".join(lines) + "\n"


def _argument_names() -> dict[str, tuple[str, str]]:
    """Every accepted keyword (field names and aliases) -> (group, field)."""
    out = {}
    for group, t in EngineConfig.groups().items():
        for f in dataclasses.fields(t):
            for key in (f.name, *f.metadata.get("aliases", ())):
                out[key] = (group, f.name)
    return out
