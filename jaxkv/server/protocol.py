"""The wire format of the OpenAI-compatible server: request models and response bodies.

Design notes: docs/server.md."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxkv.engine.outputs import CompletionOutput, RequestOutput
from jaxkv.sample.sampler import SamplingParams
from jaxkv.sample.structured import StructuredOutputsParams
from jaxkv.server import tool_calls

# OpenAI caps top_logprobs at 20; so does the engine (jaxkv.sample.sampler.MAX_LOGPROBS).
MAX_TOP_LOGPROBS = 20


_GUIDED = "vLLM's older name: use structured_outputs"
_FUNCTIONS = "OpenAI's older name: use tools / tool_choice"
# Fields jaxkv does not implement: (the values that ask for nothing, why it is refused).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "best_of": ((1,), "one sequence is generated per choice (use n)"),
    "suffix": (("",), "insertion after a suffix is not implemented"),
    "prompt_logprobs": ((), "prompt logprobs are not computed"),
    "guided_json": ((), _GUIDED),
    "guided_regex": ((), _GUIDED),
    "guided_choice": ((), _GUIDED),
    "guided_grammar": ((), _GUIDED),
    "functions": (([],), _FUNCTIONS),
    "function_call": (("none",), _FUNCTIONS),
}
# OpenAI fields that cannot change the output: accepted and dropped.
IGNORED = frozenset({"metadata", "store", "service_tier", "prompt_cache_key",
                     "safety_identifier"})


class FieldError(ValueError):
    """A 400 about one request field, named in the error's ``param``."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def refused_field(name: str) -> str:
    """The 400 text of a field the request models do not take (pydantic's ``extra_forbidden``)."""
    if name in UNSUPPORTED:
        return f"{name} is not supported by this server: {UNSUPPORTED[name][1]}"
    return f"Unrecognized request argument supplied: {name}"


def validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """The 400 message and ``param`` of pydantic's errors about a request body: malformed JSON
    by its position (no param), a field the models do not take by ``refused_field``, any other
    error after its field."""
    if not errors:
        return "invalid request", None
    if errors[0]["type"] == "json_invalid":
        pos, why = errors[0]["loc"][-1], errors[0].get("ctx", {}).get("error")
        return f"the body is not valid JSON: {why} at character {pos}", None
    parts = [refused_field(field_path(e["loc"][1:])) if e["type"] == "extra_forbidden"
             else f"{field_path(e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors]
    return "; ".join(parts), field_path(errors[0]["loc"][1:]) or None


def field_path(loc) -> str:
    """A pydantic location as a field path: ``("messages", 0, "content")`` is
    ``messages[0].content``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def check_unicode(value, path: str = "") -> None:
    """Refuses a lone surrogate in any string of ``value`` (a request as plain data): JSON can
    spell one (``"\\ud800"``), but it is no text: no tokenizer and no UTF-8 answer can take it.

    Raises:
      FieldError: naming the string's field (``prompt``, ``messages[1].content``).
    """
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise FieldError(path, f"{path} holds a lone surrogate ({value[e.start]!r} at "
                                       f"character {e.start}): text must be valid Unicode"
                                 ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}[{i}]")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = False      # accepted: no obfuscation padding is sent


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_no_ops(cls, data):
        """Drops the ``IGNORED`` fields and the ``UNSUPPORTED`` ones that ask for nothing;
        ``extra="forbid"`` refuses the rest."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if k not in IGNORED and not (k in UNSUPPORTED and
                                             (v is None or v in UNSUPPORTED[k][0]))}

    def sampling_params(self, prompt_len: int, max_model_len: int, *, max_tokens: int | None,
                        logprobs: int | None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's ``SamplingParams``; without ``max_tokens`` the rest of the context
        (vLLM's default), at least 1 so an over-long prompt gets the length error.
        ``constraint``: the grammar of the request's tool calls (jaxkv/server/tools.py).

        Raises:
          TypeError, ValueError: a field out of range, named (from ``SamplingParams``); a tool
            constraint with response_format / structured_outputs.
        """
        if max_tokens is None:
            max_tokens = max(1, max_model_len - prompt_len)
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                "presence_penalty", "frequency_penalty",
                                                "repetition_penalty", "seed")
                 if getattr(self, k) is not None}
        return SamplingParams(n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
                              stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=logprobs,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              logit_bias=self._logit_bias(),
                              allowed_token_ids=self.allowed_token_ids,
                              bad_words=self.bad_words,
                              structured_outputs=self._constraint(constraint), **given)

    def _constraint(self, tools: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """The grammar of the tool calls, or of ``response_format`` / ``structured_outputs``."""
        own = self._structured_outputs()
        if tools is not None and own is not None:
            raise FieldError("tool_choice", "tool_choice \"required\" or a named function "
                                            f"constrains the answer: drop {self.constraint_field}")
        return tools or own

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of ``response_format`` (OpenAI's ``json_object`` / ``json_schema``;
        ``text`` asks for none) or vLLM's ``structured_outputs`` body (its field names).

        Raises:
          FieldError: naming the field that is malformed, or both given.
        """
        fmt, extra = self.response_format, self.structured_outputs
        if fmt is not None and extra is not None:
            raise FieldError("structured_outputs", "give response_format or "
                                                   "structured_outputs, not both")
        if extra is not None:
            try:
                return StructuredOutputsParams(**extra)
            except TypeError as e:   # an unknown key
                raise FieldError("structured_outputs", f"structured_outputs: {e}") from None
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = (fmt.get("json_schema") or {}).get("schema")
        if fmt.get("type") != "json_schema" or not isinstance(schema, dict):
            raise FieldError("response_format", "response_format: give {\"type\": \"text\"}, "
                             "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                             "\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return StructuredOutputsParams(json=schema)

    def _logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys (token ids as JSON strings, as OpenAI sends them) as
        ints; a key that is not one is a ``FieldError`` naming it."""
        if self.logit_bias is None:
            return None
        bad = [k for k in self.logit_bias if not k.strip().isdigit()]
        if bad:
            raise FieldError("logit_bias", f"logit_bias: key {bad[0]!r} is not a token id")
        return {int(k): v for k, v in self.logit_bias.items()}

    @property
    def constraint_field(self) -> str:
        """The field a structured-output constraint came from, for a 400 naming it."""
        return "response_format" if self.response_format is not None else "structured_outputs"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | dict]:
        """The prompts as the engine takes them: str or ``{"prompt_token_ids": [...]}``."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        if not p:
            raise ValueError("prompt must not be empty")
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


class ChatMessage(BaseModel):
    """One message; ``content`` is a str or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def as_dict(self) -> dict:
        """The message for the chat template (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ValueError("messages: only text content parts are supported")
            content = "".join(str(part.get("text", "")) for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: a conversation rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    # checked here, so its 400 names it (the engine's text would say max_tokens)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def num_logprobs(self) -> int | None:
        """Top-N the engine must return per token (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """``POST /tokenize``: a text ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error schema: ``{"error": {message, type, param, code}}`` (a lone surrogate of
    the request quoted in the message or param is escaped: the body must encode as UTF-8)."""
    def text(s):
        return s if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": text(message), "type": kind, "param": text(param),
                      "code": status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(c: CompletionOutput) -> str | None:
    """OpenAI's finish reason of a completion (``stop``, ``length``; ``abort``/``error`` as is)."""
    return c.finish_reason


class LogprobFormatter:
    """Turns a completion's per-token ``{id: logprob}`` entries into either logprobs schema.

    Args:
      tokenizer: the model's tokenizer (``token_bytes`` for exact bytes).
      num: the top-N requested (the engine adds the chosen token to each entry).
    """

    def __init__(self, tokenizer, num: int):
        self.tokenizer = tokenizer
        self.num = num

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def _top(self, entry: dict[int, float], chosen: int) -> list[tuple[int, float]]:
        """The top-N of an entry (the chosen token is in the entry only to give its logprob)."""
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        return ranked[:self.num] if self.num else []

    def chat(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict:
        """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}``."""
        def item(tid: int, lp: float) -> dict:
            return {"token": self._text(tid), "logprob": lp,
                    "bytes": list(self.tokenizer.token_bytes(tid))}
        return {"content": [{**item(t, e[t]), "top_logprobs": [item(i, v) for i, v in
                                                               self._top(e, t)]}
                            for t, e in zip(token_ids, entries)]}

    def completion(self, token_ids: list[int], entries: list[dict[int, float]],
                   offset: int) -> dict:
        """The legacy ``{tokens, token_logprobs, top_logprobs, text_offset}``; ``offset`` is
        the length of the text before the first of these tokens."""
        tokens = [self._text(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": [self._top_by_text(e, t) for t, e in zip(token_ids, entries)],
                "text_offset": offsets}

    def _top_by_text(self, entry: dict[int, float], chosen: int) -> dict[str, float]:
        """The legacy top-N keyed by text: tokens that decode to the same text (byte-fallback
        pieces, shown as U+FFFD) share one key, which keeps the best of their logprobs."""
        top: dict[str, float] = {}
        for token_id, logprob in self._top(entry, chosen):
            top.setdefault(self._text(token_id), logprob)
        return top


def completion_body(request_id: str, model: str, outputs: list[RequestOutput],
                    echo_texts: list[str], fmt: LogprobFormatter | None) -> dict:
    """The non-streamed ``text_completion`` of one request per prompt, ``n`` choices each."""
    choices, n_prompt, n_out = [], 0, 0
    for p, (out, echo) in enumerate(zip(outputs, echo_texts)):
        n_prompt += len(out.prompt_token_ids)
        for c in out.outputs:
            n_out += len(c.token_ids)
            choices.append({
                "index": p * len(out.outputs) + c.index, "text": echo + c.text,
                "logprobs": None if fmt is None else fmt.completion(c.token_ids, c.logprobs,
                                                                    len(echo)),
                "finish_reason": finish_reason(c), "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(n_prompt, n_out)}


def chat_body(request_id: str, model: str, out: RequestOutput,
              fmt: LogprobFormatter | None, tool_parser=None) -> dict:
    """The non-streamed ``chat.completion``, ``n`` choices; with a ``tool_parser``
    (jaxkv/server/tool_calls.py), the calls it finds in each as ``tool_calls``."""
    def choice(c: CompletionOutput) -> dict:
        message, has_calls = ({"role": "assistant", "content": c.text}, False) \
            if tool_parser is None else tool_calls.message(tool_parser, c.text)
        return {"index": c.index, "message": message,
                "logprobs": None if fmt is None else fmt.chat(c.token_ids, c.logprobs),
                "finish_reason": tool_calls.finish_reason(c.finish_reason, has_calls),
                "stop_reason": c.stop_reason}

    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice(c) for c in out.outputs],
            "usage": usage(len(out.prompt_token_ids),
                           sum(len(c.token_ids) for c in out.outputs))}


def chunk(request_id: str, model: str, created: int, kind: Literal["completion", "chat"],
          choices: list[dict], usage_: dict | None = None) -> dict:
    """One streamed chunk (``choices: []`` plus ``usage`` for the final usage chunk)."""
    body = {"id": request_id,
            "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
            "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body
