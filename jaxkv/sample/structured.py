"""Structured outputs: a request's JSON schema, regex, choice list or EBNF grammar, compiled by
xgrammar into a matcher that fills the step's token bitmask (jaxkv/sample/logit_controls.py)
for every position a row samples, drafts included, and advances on every emitted token.

Design notes: docs/runtime.md."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxkv.config.checks import BOOLS, check_type

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
      json: a JSON schema (a dict, or its JSON text); stored as JSON text (its properties in
        their order: the output follows it).
      regex: a regular expression the whole output matches.
      choice: the output is one of these strings (a non-empty list of str; stored as a tuple).
      grammar: an EBNF grammar (xgrammar's / GBNF syntax, rule ``root``).
      json_object: any JSON object.
      disable_any_whitespace: JSON without optional whitespace (``", "`` and ``": "``
        separators); default: any whitespace, as vLLM.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self):
        """Checks that exactly one constraint is given, with its type; ``json`` must parse."""
        for name in ("json_object", "disable_any_whitespace"):
            object.__setattr__(self, name, bool(check_type(name, getattr(self, name), BOOLS,
                                                           "a bool")))
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(_KINDS)} "
                             f"(got {', '.join(given) or 'none'})")
        if self.json is not None:
            check_type("structured_outputs.json", self.json, (str, dict), "a dict or JSON text")
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                object.__setattr__(self, "json", json.dumps(schema))
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json: not a JSON schema: {e}") from None
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                check_type(f"structured_outputs.{name}", getattr(self, name), (str,), "a str")
        if self.choice is not None:
            check_type("structured_outputs.choice", self.choice, (list, tuple), "a list of str")
            if not self.choice:
                raise ValueError("structured_outputs.choice=[]: the list is empty")
            object.__setattr__(self, "choice", tuple(
                check_type(f"structured_outputs.choice[{i}]", c, (str,), "a str")
                for i, c in enumerate(self.choice)))

    @property
    def kind(self) -> str:
        """The constraint given: one of ``json``, ``regex``, ``choice``, ``grammar``,
        ``json_object``."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))


class GrammarCompiler:
    """Compiles constraints for one tokenizer (xgrammar's ``GrammarCompiler``), caching each
    distinct one (least recently used out past ``cache_size``); thread-safe.

    Args:
      tokenizer: the engine's ``jaxkv.model.tokenizer.Tokenizer``.
      vocab_size: the logits width ``V`` (the model's, at least the tokenizer's).
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(_tokenizer_info(xgr, tokenizer, vocab_size))
        self._cache: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of ``spec`` (cached).

        Raises:
          ValueError: xgrammar cannot compile it, naming ``structured_outputs.<kind>``.
        """
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip().splitlines()[-1])
            raise ValueError(f"structured_outputs.{spec.kind}: cannot be compiled: "
                             f"{reason}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        c, ws = self._compiler, not spec.disable_any_whitespace
        if spec.json is not None:
            return c.compile_json_schema(spec.json, any_whitespace=ws)
        if spec.json_object:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=ws)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:   # JSON string literals are EBNF string literals
            return c.compile_grammar("root ::= " + " | ".join(map(json.dumps, spec.choice)))
        return c.compile_grammar(spec.grammar)

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        """A fresh matcher of ``spec`` at the start of the output."""
        return Matcher(_xgrammar().GrammarMatcher(self.compile(spec)), self.vocab_size)


class Matcher:
    """Where one sample's output stands in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self._words = -(-vocab_size // 32)

    def bitmasks(self, drafts: Sequence[int]) -> np.ndarray:
        """int32 ``[len(drafts) + 1, ceil(V / 32)]``: the tokens allowed at the next position
        and after each draft (all allowed past a draft the grammar refuses: such a position is
        never emitted); the matcher is left where it was."""
        out = np.full((len(drafts) + 1, self._words), -1, np.int32)
        advanced = 0
        for j in range(len(drafts) + 1):
            self._m.fill_next_token_bitmask(out, j)
            if j == len(drafts) or not self._m.accept_token(int(drafts[j])):
                break
            advanced += 1
        if advanced:
            self._m.rollback(advanced)
        return out

    def accept(self, token: int) -> bool:
        """Advances past an emitted ``token``; True when the grammar has ended (its stop
        token accepted). Raises ValueError if the grammar refuses the token."""
        if not self._m.accept_token(int(token)):
            raise ValueError(f"token {token} is outside the request's structured_outputs "
                             f"grammar")
        return self._m.is_terminated()


def _xgrammar():
    """The ``xgrammar`` module (a ValueError naming the field when it is not installed)."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured_outputs needs the xgrammar package: "
                         "pip install 'jaxkv[structured]'") from None
    return xgrammar


def _tokenizer_info(xgr, tokenizer, vocab_size: int):
    """xgrammar's view of ``tokenizer``: each token's bytes (its ``from_huggingface``
    decoding: byte-level and SentencePiece vocabularies alike), special tokens empty (never
    inside a grammar's text, as vLLM keeps them out of JSON), the eos ids as stop tokens."""
    import transformers

    stop = list(tokenizer.eos_token_ids)
    base = xgr.TokenizerInfo.from_huggingface(
        transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
        vocab_size=vocab_size, stop_token_ids=stop)
    vocab = list(base.decoded_vocab) + [b""] * (vocab_size - len(base.decoded_vocab))
    for i, added in tokenizer.backend.get_added_tokens_decoder().items():
        if added.special and i < vocab_size:
            vocab[i] = b""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stop)
