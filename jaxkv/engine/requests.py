"""Per-request host bookkeeping of the engine: what a request is and how its outputs are built.

``RequestTable`` validates prompts into requests, holds the live ones and turns finished samples
into ``RequestOutput``s; nothing here touches the device. A request with ``n > 1`` runs as ``n``
scheduler sequences ``"<id>#<i>"`` whose seeds are ``seed + i`` (as vLLM does); samples ``i > 0``
fork sample 0 once its prompt is computed, sharing the prompt's blocks (copy-on-write). Each
``Sample`` keeps its detokenized text, stop strings and logprobs; its ``EngineRequest`` the metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping

import numpy as np

from jaxkv.config.checks import check_number, check_token_ids, check_type
from jaxkv.engine.detokenize import IncrementalDetokenizer
from jaxkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxkv.model.tokenizer import Tokenizer
from jaxkv.sample import logit_controls, structured
from jaxkv.sample.sampler import MAX_LOGPROBS, SamplingParams
from jaxkv.sched.state import FINISH_STOP, Request, RequestState, StopSpec

FINISH_ERROR = "error"   # the request failed inside a step (RequestOutput.error says why)
# The keys of a token prompt dict (vLLM's TokensPrompt, without multi-modal data).
_PROMPT_KEYS = frozenset({"prompt_token_ids", "prompt"})


@dataclasses.dataclass
class Sample:
    """Host bookkeeping of one scheduler sequence (one of a request's ``n`` samples)."""

    parent: str
    params: SamplingParams
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    matcher: structured.Matcher | None = None   # where its structured output stands

    def append(self, token: int, logprob: float, top_ids: np.ndarray,
               top_vals: np.ndarray) -> bool:
        """Appends one sampled token: its logprobs, the detokenized text and the stop strings.

        Args:
          token: the sampled token id.
          logprob: its log-probability.
          top_ids: [N] int32, the step's top-N token ids for this sample (N >= ``params.logprobs``
            when logprobs are requested; read only then).
          top_vals: [N] float32, their log-probabilities.

        Returns:
          True if a stop string matched (see ``_apply_stop_strings``) or the structured
          output's grammar ended.
        """
        ended = self.matcher is not None and self.matcher.accept(token)
        comp = self.completion
        comp.token_ids.append(token)
        comp.cumulative_logprob += logprob
        if comp.logprobs is not None:
            n = self.params.logprobs
            entry = {int(i): float(v) for i, v in zip(top_ids[:n], top_vals[:n])}
            entry[token] = logprob
            comp.logprobs.append(entry)
        searched = len(self.detokenizer.text)
        self.detokenizer.update(comp.token_ids)
        return self._apply_stop_strings(searched) or ended

    def _apply_stop_strings(self, searched: int) -> bool:
        """Sets the completion's text after new tokens, trimmed before the earliest stop string
        (after it with ``include_stop_str_in_output``).

        The full text is ``detokenizer.text + detokenizer.pending``; its first ``searched``
        characters (committed before this step) held no stop string, so only what follows them,
        with the last ``len(stop) - 1`` characters before, is searched. Without a match the text
        is the committed text less the last ``max(len(stop)) - 1`` characters, which a stop
        string completed later could still trim, so the texts a stream sees only ever grow.

        Args:
          searched: ``len(detokenizer.text)`` before the update.

        Returns:
          True if a stop string matched (then ``stop_reason`` is set to it).
        """
        comp, detok = self.completion, self.detokenizer
        hold = max([len(s) - 1 for s in self.params.stop if s], default=0)
        start = max(0, searched - hold)
        tail = detok.text[start:] + detok.pending
        hits = [(tail.find(s), s) for s in self.params.stop if s and s in tail]
        if not hits:
            comp.text = detok.text[:max(0, len(detok.text) - hold)]
            return False
        pos, stop = min(hits)
        comp.text = detok.text[:start] + tail[:pos + (
            len(stop) if self.params.include_stop_str_in_output else 0)]
        comp.stop_reason = stop
        return True

    def finish(self, finish_reason: str) -> None:
        """Marks the completion finished: its full text unless a stop string trimmed it, and a
        stop token as ``stop_reason`` when a stop token (or eos) ended it."""
        comp = self.completion
        comp.finish_reason = finish_reason
        if comp.stop_reason is None:   # no stop string trimmed it: all of the text
            comp.text = self.detokenizer.text + self.detokenizer.pending
        if comp.stop_reason is None and finish_reason == FINISH_STOP and comp.token_ids:
            comp.stop_reason = comp.token_ids[-1]


@dataclasses.dataclass
class EngineRequest:
    """Host bookkeeping of one request: its prompt, its ``n`` samples and its metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample]
    metrics: RequestMetrics
    num_cached_tokens: int | None = None

    def output(self) -> RequestOutput:
        """A snapshot of the request as a ``RequestOutput`` (later steps do not change it)."""
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids),
                             [dataclasses.replace(s.completion, token_ids=list(
                                 s.completion.token_ids)) for s in self.samples],
                             dataclasses.replace(self.metrics), self.num_cached_tokens)


class RequestTable:
    """The engine's live requests on the host, and the validation of new ones.

    Args:
      tokenizer: the model's tokenizer (prompts, eos ids, detokenization).
      vocab_size: token ids of prompts must lie in ``[0, vocab_size)``.
      max_model_len: longest prompt + ``max_tokens``.

    Attributes:
      requests: live requests by request id.
      samples: their unfinished samples by scheduler sequence id ``"<id>#<i>"``.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.requests: dict[str, EngineRequest] = {}
        self.samples: dict[str, Sample] = {}
        self._ids = itertools.count()
        self._grammars: structured.GrammarCompiler | None = None   # built on first use

    def grammars(self) -> structured.GrammarCompiler:
        """The structured-output compiler of this tokenizer (built on first use)."""
        if self._grammars is None:
            self._grammars = structured.GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars

    def tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt.

        A prompt is a non-empty str, or a dict (vLLM's ``TokensPrompt``) with
        ``"prompt_token_ids"``, a non-empty list / tuple of ints or 1-D integer array, and
        optionally ``"prompt"``, its text (a str, reported back in the output). Every id, the
        tokenizer's included, must lie in ``[0, vocab_size)``.

        Raises:
          ParamTypeError: a prompt, text or token id of the wrong type (a ``TypeError``).
          ValueError: an empty prompt, an unknown dict key, or an id outside the vocabulary.
        """
        check_type("prompt", prompt, (str, dict), "a str or a dict with 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            if set(prompt) - _PROMPT_KEYS or "prompt_token_ids" not in prompt:
                raise ValueError(f"prompt has keys {sorted(prompt, key=repr)}: it must have "
                                 f"'prompt_token_ids' and may have 'prompt', nothing else")
            text = prompt.get("prompt")
            if text is not None:
                check_type("prompt['prompt']", text, (str,), "None or a str")
            ids = prompt["prompt_token_ids"]
        ids = check_token_ids("prompt_token_ids", ids, self.vocab_size)
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        return text, ids

    def new_request(self, prompt: str | dict, params: SamplingParams, *, priority: int = 0,
                    request_id: str | int | None = None, cache_salt: str | None = None
                    ) -> tuple[EngineRequest, list[Request]]:
        """Validates one request; returns it and its ``n`` scheduler requests, adding nothing
        (``add`` does, once the scheduler took them).

        Args:
          prompt: see ``tokenize``.
          params: its ``SamplingParams``; ``logprobs <= MAX_LOGPROBS`` and every stop token id
            (and ``logit_bias`` / ``allowed_token_ids`` id) inside the vocabulary.
          priority: an int (Python or numpy); lower is more urgent.
          request_id: a str, or an int (stored as its decimal str, so ``abort_request`` takes
            either), not in use by a live request; None picks the next free counter value.
          cache_salt: None or a str: the prefix-cache namespace.

        Raises:
          ParamTypeError: naming the field of the wrong type (a ``TypeError``).
          ValueError: naming the bad value; nothing is queued either way.
        """
        check_type("sampling_params", params, (SamplingParams,), "a SamplingParams")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={MAX_LOGPROBS}")
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
        check_token_ids("logit_bias", [i for i, _ in params.logit_bias or ()], self.vocab_size)
        check_token_ids("allowed_token_ids", params.allowed_token_ids or (), self.vocab_size)
        if params.bad_words:   # vLLM's tokenization, kept with the params
            params = dataclasses.replace(params, bad_words_token_ids=(
                params.bad_words_token_ids
                + logit_controls.bad_words_token_ids(self.tokenizer, params.bad_words)))
        for i, seq in enumerate(params.bad_words_token_ids):
            check_token_ids(f"bad_words_token_ids[{i}]", seq, self.vocab_size)
        spec = params.structured_outputs
        if spec is not None:
            self.grammars().compile(spec)   # a bad schema or grammar: ValueError naming it
        priority = check_number("priority", priority, int)
        check_type("cache_salt", cache_salt, (str, type(None)), "None or a str")
        check_type("request_id", request_id, (str, int, np.integer, type(None)),
                   "None, a str or an int")
        text, ids = self.tokenize(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt's {len(ids)} tokens + max_tokens={params.max_tokens} "
                             f"exceed max_model_len={self.max_model_len}")
        if request_id is None:
            rid = next(r for r in map(str, self._ids) if r not in self.requests)
        else:
            rid = request_id if isinstance(request_id, str) else str(int(request_id))
            if rid in self.requests:
                raise ValueError(f"request_id={rid!r} is already in use")
        now = time.perf_counter()
        samples, reqs = [], []
        for i in range(params.n):
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            samples.append(Sample(rid, p, CompletionOutput(
                index=i, logprobs=[] if params.logprobs is not None else None),
                IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens),
                None if spec is None else self.grammars().matcher(spec)))
            stop = StopSpec(max_tokens=p.max_tokens, min_tokens=p.min_tokens,
                                      stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
                                      eos_token_ids=self.tokenizer.eos_token_ids)
            reqs.append(Request(request_id=f"{rid}#{i}", prompt_token_ids=ids, stop=stop,
                                          arrival_time=now, priority=priority,
                                          cache_salt=cache_salt,
                                          fork_of=f"{rid}#0" if i else None))
        return EngineRequest(rid, text, ids, samples, RequestMetrics(arrival_time=now)), reqs

    def add(self, new: list[tuple[EngineRequest, list[Request]]]) -> None:
        """Registers requests from ``new_request`` that the scheduler has taken."""
        for req, reqs in new:
            self.requests[req.request_id] = req
            for r, sample in zip(reqs, req.samples):
                self.samples[r.request_id] = sample

    def collect_finished(self, finished: Mapping[str, RequestState]
                         ) -> list[RequestOutput]:
        """Finishes the samples of the scheduler's ``finished`` sequences; returns (and forgets)
        the requests whose samples are now all finished."""
        out = []
        now = time.perf_counter()
        for seq_id, rs in finished.items():
            sample = self.samples.pop(seq_id, None)
            if sample is None:
                continue
            sample.finish(rs.finish_reason)
            req = self.requests[sample.parent]
            if all(s.completion.finished for s in req.samples):
                req.metrics.finished_time = now
                out.append(req.output())
                del self.requests[req.request_id]
        return out

    def seq_ids(self, request_id: str) -> list[str]:
        """Scheduler sequence ids of the request's unfinished samples."""
        req = self.requests[request_id]
        return [f"{request_id}#{i}" for i, s in enumerate(req.samples)
                if not s.completion.finished]

    def fail(self, request_id: str, error: str) -> RequestOutput:
        """Finishes every unfinished sample of a live request with ``finish_reason="error"``;
        returns (and forgets) its final output, carrying ``error``."""
        for seq_id in self.seq_ids(request_id):
            self.samples.pop(seq_id).finish(FINISH_ERROR)
        req = self.requests.pop(request_id)
        req.metrics.finished_time = time.perf_counter()
        return dataclasses.replace(req.output(), error=error)
