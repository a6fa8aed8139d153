"""What README.md and docs/ name exists and works: every ``jaxkv.`` name resolves, every import
in their code runs, every path is in the tree, and every engine keyword and CLI flag the README
shows is accepted (with each documented choice), so a move or a rename cannot leave the
documentation behind."""

import argparse
import ast
import importlib
import re
from pathlib import Path

import pytest

from jaxkv.config import EngineConfig
from jaxkv.config.engine import _argument_names
from jaxkv.entrypoints.cli import build_parser
from jaxkv.sample.sampler import SamplingParams
from jaxkv.sample.structured import StructuredOutputsParams

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = "\n".join(p.read_text(encoding="utf-8") for p in DOCS)
README = DOCS[0].read_text(encoding="utf-8")   # the user's options: keywords and flags
# keywords the documents show that are not engine or sampling arguments
OTHER_KEYWORDS = {"durations", "impl", "finish_reason", "finished_reason"}
OTHER_FLAGS = {"--dist", "--durations"}   # pytest's, in the test command


def resolve(dotted: str):
    """The object a dotted ``jaxkv....`` name refers to (the longest importable module, then
    attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("dotted", sorted(set(re.findall(
    r"\bjaxkv(?:\.[A-Za-z_][A-Za-z0-9_]*)+", TEXT))))
def test_every_jaxkv_name_resolves(dotted):
    assert resolve(dotted) is not None


def test_every_import_in_the_code_blocks_runs():
    blocks = re.findall(r"```python\n(.*?)```", TEXT, re.S)
    imports = [node for block in blocks for node in ast.walk(ast.parse(block))
               if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports, "the documents show no imports"
    for node in imports:
        if isinstance(node, ast.ImportFrom) and node.module.partition(".")[0] == "jaxkv":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), (node.module, alias.name)


@pytest.mark.parametrize("path", sorted(set(re.findall(
    r"(?<![\w/.])((?:jaxkv|bench|tests|docs|notebooks)/[A-Za-z0-9_./-]*[A-Za-z0-9_/])", TEXT))))
def test_every_path_exists(path):
    assert (ROOT / path).exists(), path


def test_every_keyword_is_an_argument_and_every_choice_is_accepted():
    engine = _argument_names()
    sampling = set(SamplingParams.__dataclass_fields__)
    sampling |= set(StructuredOutputsParams.__dataclass_fields__)
    spans = re.findall(r"`([^`\n]+)`", README)
    documented = {}   # key -> the quoted values shown for it
    for span in spans:
        for key, values in re.findall(r"(?<![\w.])([a-z_][a-z0-9_]*)=((?:\"[^\"]*\"(?:\s*\|\s*)?)*)",
                                      span):
            documented.setdefault(key, set()).update(re.findall(r"\"([^\"]*)\"", values))
    unknown = set(documented) - set(engine) - sampling - OTHER_KEYWORDS - {"model"}
    assert not unknown, f"documented keywords that nothing accepts: {sorted(unknown)}"
    for key, values in documented.items():
        if key in engine:
            for value in values:   # the choice is accepted (other arguments at their defaults
                kw = {key: value}  # or the ones it needs, as the documents pair them)
                try:
                    EngineConfig.from_kwargs(**kw)
                except ValueError as e:   # a choice that needs its companion argument
                    assert "needs" in str(e) or "is used only" in str(e), (key, value, e)


def cli_flags() -> set[str]:
    """Every option string of the ``jaxkv`` parser and its subcommands."""
    flags, parsers = set(), [build_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return flags


def test_every_flag_is_accepted_by_the_cli():
    documented = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", README))
    assert documented - cli_flags() - OTHER_FLAGS == set()
