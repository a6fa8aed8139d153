"""Dynamo's token protocol and jaxkv's: a ``GenerateRequest`` becomes ``SamplingParams``, each
``RequestOutput`` a ``GenerateChunk`` of the new tokens.

Plain dicts both ways (Dynamo's ``GenerateRequest`` / ``GenerateChunk`` are TypedDicts), so this
module imports no Dynamo and its tests run without it. Dynamo keeps what it does itself: the
tokenizer, stop strings (matched on its detokenized text; it then cancels the request) and
``skip_special_tokens``.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxkv.engine.outputs import RequestOutput
from jaxkv.sample.sampler import SamplingParams

logger = logging.getLogger("jaxkv.dynamo")

# sampling_options keys that map one to one onto SamplingParams
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed")
# keys Dynamo fills that change nothing here: Dynamo itself acts on them
DYNAMO_SIDE = frozenset({"stop", "include_stop_str_in_output", "skip_special_tokens",
                         "formatted_prompt"})
# the stop token ids Dynamo sends; which of them the client sees is Dynamo's business
STOP_ID_KEYS = ("stop_token_ids", "stop_token_ids_visible", "stop_token_ids_hidden")
GUIDED_KINDS = ("json", "regex", "choice", "grammar")
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}


class UnsupportedRequest(ValueError):
    """A request option jaxkv cannot honour (the engine answers it as an invalid argument)."""


def sampling_params(request: dict[str, Any], max_model_len: int) -> SamplingParams:
    """The ``SamplingParams`` of a Dynamo ``GenerateRequest`` (vLLM's mapping in Dynamo).

    ``max_tokens`` defaults to what the context leaves after the prompt; the model's eos
    ids (``stop_token_ids_hidden``) and the visible ones join the ``stop_token_ids``.

    Raises:
      UnsupportedRequest: an option with no jaxkv counterpart set to a value that asks for
        something (``n > 1``, beam search, prompt logprobs, thinking budgets ...).
      TypeError, ValueError: a value ``SamplingParams`` refuses, naming the field.
    """
    options = dict(request.get("sampling_options") or {})
    extra = request.get("extra_args") or {}
    if isinstance(extra.get("sampling_options"), dict):
        options.update(extra["sampling_options"])
    stops = request.get("stop_conditions") or {}
    outputs = request.get("output_options") or {}
    kw = {k: options[k] for k in SAMPLING_FIELDS if options.get(k) is not None}
    _refuse(options, n=1, best_of=1, use_beam_search=False, length_penalty=1.0)
    _refuse(stops, max_thinking_tokens=None)
    _refuse(outputs, prompt_logprobs=None)
    _note_unknown(options, SAMPLING_FIELDS + ("n", "best_of", "use_beam_search",
                                              "length_penalty", "guided_decoding"))
    if options.get("guided_decoding"):
        kw["structured_outputs"] = structured_outputs(options["guided_decoding"])
    prompt_len = len(request["token_ids"])
    max_tokens = stops.get("max_tokens")
    kw["max_tokens"] = max(1, max_model_len - prompt_len) if max_tokens is None else max_tokens
    for key in ("min_tokens", "ignore_eos"):
        if stops.get(key) is not None:
            kw[key] = stops[key]
    stop_ids = list(dict.fromkeys(t for key in STOP_ID_KEYS for t in stops.get(key) or ()))
    if stop_ids:
        kw["stop_token_ids"] = stop_ids
    if outputs.get("logprobs") is not None:
        kw["logprobs"] = int(outputs["logprobs"])
    return SamplingParams(**kw)


def structured_outputs(guided: dict[str, Any]):
    """Dynamo's ``guided_decoding`` (``json``, ``regex``, ``choice``, ``grammar``) as a
    ``StructuredOutputsParams``."""
    from jaxkv.sample.structured import StructuredOutputsParams

    _refuse(guided, structural_tag=None, whitespace_pattern=None)
    given = {k: guided[k] for k in GUIDED_KINDS if guided.get(k) is not None}
    return StructuredOutputsParams(**given)


def _refuse(group: dict[str, Any], **neutral) -> None:
    """Raises ``UnsupportedRequest`` for a key of ``group`` set to other than its neutral
    value (None counts as neutral)."""
    for key, value in neutral.items():
        if group.get(key) is not None and group[key] != value:
            raise UnsupportedRequest(f"{key}={group[key]!r} is not supported by the jaxkv "
                                     f"backend")


def _note_unknown(options: dict[str, Any], known: tuple[str, ...]) -> None:
    for key, value in options.items():
        if value is not None and key not in known and key not in DYNAMO_SIDE:
            logger.warning("sampling option %s=%r is not used by the jaxkv backend", key, value)


class ChunkWriter:
    """Turns one request's cumulative ``RequestOutput``s into Dynamo's delta chunks.

    Args:
      tokenizer: decodes the ``token`` of a logprob entry (None: entries carry no text).
      top_logprobs: entries per position in ``top_logprobs`` (the request's ``logprobs``; the
        engine's dict also holds the chosen token when it ranks below them).
    """

    def __init__(self, tokenizer=None, top_logprobs: int = 0):
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.sent = 0

    def chunk(self, out: RequestOutput) -> dict[str, Any] | None:
        """The chunk of ``out``'s new tokens (None when it adds none and does not finish).

        Raises:
          RuntimeError: the request failed inside a step (``finish_reason="error"``).
        """
        comp = out.outputs[0]
        if comp.finish_reason == "error":
            raise RuntimeError(f"jaxkv request failed: {out.error}")
        new = comp.token_ids[self.sent:]
        if not new and comp.finish_reason is None:
            return None
        chunk: dict[str, Any] = {"token_ids": list(new), "index": comp.index}
        if comp.logprobs is not None and new:
            chunk.update(self._logprobs(new, comp.logprobs[self.sent:self.sent + len(new)]))
        self.sent += len(new)
        if comp.finish_reason is not None:
            chunk["finish_reason"] = FINISH_REASONS.get(comp.finish_reason, comp.finish_reason)
            chunk["completion_usage"] = usage(out)
        return chunk

    def _logprobs(self, tokens: list[int], positions: list[dict[int, float]]) -> dict:
        """``log_probs`` (the chosen tokens') and ``top_logprobs`` (ranked entries)."""
        chosen, tops = [], []
        for token, position in zip(tokens, positions):
            chosen.append(float(position[token]))
            ranked = sorted(position.items(), key=lambda kv: -kv[1])[:self.top_logprobs]
            tops.append([self._entry(rank, tid, lp) for rank, (tid, lp) in
                         enumerate(ranked, 1)])
        return {"log_probs": chosen, **({"top_logprobs": tops} if self.top_logprobs else {})}

    def _entry(self, rank: int, token_id: int, logprob: float) -> dict[str, Any]:
        text = None if self.tokenizer is None else self.tokenizer.decode(
            [token_id], skip_special_tokens=False)
        return {"rank": rank, "token_id": int(token_id), "token": text,
                "logprob": float(logprob),
                "bytes": None if self.tokenizer is None else list(
                    self.tokenizer.token_bytes(token_id))}


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's ``usage`` of a finished request, with the prompt tokens the prefix cache had."""
    prompt = len(out.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in out.outputs)
    body = {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
    if out.num_cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
    return body


def cancelled_chunk(prompt_len: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a request Dynamo cancelled (its context stopped)."""
    return {"token_ids": [], "index": 0, "finish_reason": "cancelled",
            "completion_usage": {"prompt_tokens": prompt_len,
                                 "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_len + completion_tokens}}
