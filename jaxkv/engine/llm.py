"""LLM: the synchronous facade over ``EngineCore`` (vLLM's ``LLM`` API shape).

    llm = LLM(model="SmolLM2-135M-Instruct", max_num_seqs=16)
    outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    for partial in llm.stream("It is a truth"): print(partial.outputs[0].text)

Every request added through the facade has its own queue; whichever caller steps the engine
(``generate``, a stream's ``next``, ``step``) puts each output into the queue of the request it
belongs to, so any number of streams, interleaved in one thread or spread over threads, and a
``generate`` running beside them each see exactly their own outputs. A call that returns or
raises (an exception, a ``KeyboardInterrupt``) aborts the requests it added and no others.

The engine arguments are those of ``jaxkv.config.EngineConfig`` (listed below).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from jaxkv.config import EngineConfig, describe_arguments
from jaxkv.engine import beam_search
from jaxkv.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxkv.engine.core import EngineCore
from jaxkv.engine.outputs import RequestOutput
from jaxkv.sample.sampler import SamplingParams


class LLM:
    """An offline inference engine over a paged KV cache with continuous batching.

    Args:
      model: a store name (default ``"SmolLM2-135M-Instruct"``), a ``.gguf`` file, an HF
        model directory or an orbax checkpoint (``jaxkv convert``).
      **kwargs: engine arguments (``EngineConfig.from_kwargs``; vLLM's names where they mean
        the same thing), listed below.

    Raises:
      TypeError: an unknown engine argument or a value of the wrong type, naming it.
      ValueError: a value that cannot work (range, geometry, memory), naming it, before any
        weight is loaded where possible.

    Engine arguments:
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs):
        self.engine = EngineCore(EngineConfig.from_kwargs(model=model, **kwargs))
        self._lock = threading.RLock()
        self._queues: dict[str, deque[RequestOutput]] = {}   # request id -> undelivered outputs
        self._stepped: set[str] = set()   # added by add_request: their outputs go to step()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """An engine of an ``EngineConfig`` (e.g. ``EngineConfig.from_cli(args)``)."""
        return cls(**config.to_kwargs())

    # ------------------------------------------------------------------ shortcuts

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def cache_config(self):
        return self.engine.cache_config

    @property
    def sched_config(self):
        return self.engine.sched_config

    @property
    def memory_plan(self):
        return self.engine.memory_plan

    @property
    def kv_cache_dtype(self) -> str:
        return self.engine.runner.kv_cache_dtype

    # ------------------------------------------------------------------ routing

    def _add(self, requests: list[dict]) -> list[str]:
        """Adds requests to the engine (all or none) and gives each its output queue."""
        with self._lock:
            for i, r in enumerate(requests):   # a finished request whose output is undelivered
                if r.get("request_id") is not None and str(r["request_id"]) in self._queues:
                    raise ValueError(f"requests[{i}]: request_id={r['request_id']!r} is already "
                                     f"in use (its outputs are not all delivered yet)")
            ids = self.engine.add_requests(requests)
            for rid in ids:
                self._queues[rid] = deque()
            return ids

    def _pump(self, rid: str | None = None) -> None:
        """Steps the engine once, routing every output to its request's queue; skips the step
        when ``rid``'s queue already holds outputs (another caller stepped meanwhile).

        Raises:
          RuntimeError: ``rid`` can never get another output (nothing is left to step).
        """
        with self._lock:
            if rid is not None and self._queues[rid]:
                return
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"request {rid!r} got no final output and the engine is idle")
            for out_id, out in self.engine.step().items():
                queue = self._queues.get(out_id)
                if queue is not None:
                    queue.append(out)

    def _release(self, ids: Sequence[str]) -> None:
        """Forgets the queues of ``ids``, aborting those still queued or running."""
        with self._lock:
            for rid in ids:
                self._queues.pop(rid, None)
                self._stepped.discard(rid)
                if self.engine.is_live(rid):
                    self.engine.abort_request(rid)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        """Queues one request whose outputs ``step()`` returns; returns its id.

        Args are those of ``EngineCore.add_request``.

        Raises:
          TypeError, ValueError: naming the bad field; nothing is queued then.
        """
        rid = self._add([dict(prompt=prompt, sampling_params=sampling_params,
                              request_id=request_id, priority=priority, cache_salt=cache_salt)])[0]
        self._stepped.add(rid)
        return rid

    def abort_request(self, request_id: str) -> None:
        """Aborts a queued or running request; its blocks are freed at once.

        Raises:
          ValueError: ``request_id`` is not queued or running.
        """
        with self._lock:
            self.engine.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the outputs of the ``add_request`` requests that got
        tokens or finished since the last ``step`` (a finished one once, then forgotten).
        Outputs of requests owned by ``generate`` or a stream go to them instead."""
        with self._lock:
            if self.engine.has_unfinished_requests():
                self._pump()
            out = []
            for rid in list(self._stepped):
                queue = self._queues[rid]
                while queue:
                    out.append(queue.popleft())
                    if out[-1].finished:
                        self._queues.pop(rid)
                        self._stepped.discard(rid)
                        break
            return out

    def has_unfinished_requests(self) -> bool:
        """Whether the engine has a request queued or running (any caller's)."""
        return self.engine.has_unfinished_requests()

    # ------------------------------------------------------------------ high level

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 = None, *, use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generates completions for a batch of prompts with continuous batching.

        Args:
          prompts: a str, a ``{"prompt_token_ids": [...]}`` dict, or a list of them.
          sampling_params: one ``SamplingParams`` for all, or one per prompt (default vLLM's:
            temperature 1, max_tokens 16).
          use_tqdm: show a progress bar of finished requests.
          priority: per-prompt priorities (policy ``"priority"``; lower is more urgent).
          cache_salt: prefix-cache namespace of these prompts (a str): they share cached
            blocks only with requests of the same salt.

        Returns:
          One ``RequestOutput`` per prompt, in input order (``finish_reason="error"`` and
          ``error`` set for a request that failed inside a step).

        Raises:
          TypeError, ValueError: naming the bad prompt or field; nothing is queued then and
            requests already in the engine keep running.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        prio = list(priority) if priority is not None else [0] * len(prompts)
        if len(prio) != len(prompts):
            raise ValueError(f"priority has {len(prio)} entries for {len(prompts)} prompts")
        ids = self._add([dict(prompt=p, sampling_params=sp, priority=pr, cache_salt=cache_salt)
                         for p, sp, pr in zip(prompts, params, prio)])
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), disable=not use_tqdm, desc="Generating", unit="req") as bar:
                while len(results) < len(ids):
                    self._pump()
                    for rid in ids:
                        queue = self._queues[rid]
                        while queue:
                            out = queue.popleft()
                            if out.finished:
                                results[rid] = out
                                bar.update(1)
        finally:
            self._release(ids)
        return [results[rid] for rid in ids]

    def stream(self, prompt, sampling_params: SamplingParams | None = None, *,
               request_id: str | None = None, priority: int = 0,
               cache_salt: str | None = None) -> "RequestStream":
        """Queues one prompt at once and returns an iterator of its ``RequestOutput`` after
        every step that adds tokens (the last one finished).

        Other requests (other streams, a ``generate``) advance in the same steps. Closing the
        iterator (``close()``, leaving a ``with`` block, or dropping it) aborts the request.

        Raises:
          TypeError, ValueError: naming the bad field; nothing is queued then.
        """
        rid = self._add([dict(prompt=prompt, sampling_params=sampling_params,
                              request_id=request_id, priority=priority, cache_salt=cache_salt)])[0]
        return RequestStream(self, rid)

    def chat(self, messages, sampling_params: SamplingParams | None = None, *,
             use_tqdm: bool = True, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of ``{"role", "content"}``) or a list
        of them, rendered with the model's chat template."""
        return self.generate(chat_prompts(self.tokenizer, messages), sampling_params,
                             use_tqdm=use_tqdm, cache_salt=cache_salt)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search over one prompt or a list of them (see jaxkv/engine/beam_search.py); the
        beams share their blocks and copy only a diverging last block. Needs an idle engine."""
        with self._lock:
            return beam_search.run(self.engine, prompts, params)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        """``EngineCore.stats()``: KV usage, queue lengths, throughput and prefix-cache counters."""
        with self._lock:
            return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (running requests keep their blocks)."""
        with self._lock:
            self.engine.reset_prefix_cache()

    def warmup(self, shapes: Sequence[tuple[int, int]] | None = None) -> int:
        """Compiles every step bucket, or the padded ``shapes`` only (``EngineCore.warmup``);
        returns how many step variants."""
        with self._lock:
            return self.engine.warmup(shapes)

    def num_compilations(self) -> int:
        """How many step variants have been compiled (a steady state adds none)."""
        return self.engine.runner.num_compilations()

    def compiled_step_text(self, num_tokens: int, num_seqs: int) -> str:
        """The optimized HLO of the step for one bucket (``ModelRunner.compiled_step_text``)."""
        return self.engine.runner.compiled_step_text(num_tokens, num_seqs)

    def close(self) -> None:
        """Frees device memory (params and cache); the engine cannot be used afterwards."""
        with self._lock:
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


LLM.__doc__ += describe_arguments(indent=6)


def chat_prompts(tokenizer, messages) -> list[dict]:
    """Token-id prompts of one conversation (a list of ``{"role", "content"}``) or a list of
    them, rendered with the model's chat template (its special tokens kept as they are)."""
    convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    return [{"prompt": t, "prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)}
            for t in map(tokenizer.apply_chat_template, convs)]


class RequestStream(Iterator[RequestOutput]):
    """The outputs of one request, step by step (``LLM.stream``); a context manager.

    ``next`` returns the request's next undelivered output, stepping the engine when there is
    none yet; after the finished output it raises StopIteration. ``close`` aborts an
    unfinished request.
    """

    def __init__(self, llm: LLM, request_id: str):
        self._llm = llm
        self.request_id = request_id
        self._done = False

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        try:
            queue = self._llm._queues[self.request_id]
            while not queue:
                self._llm._pump(self.request_id)
            out = queue.popleft()
        except BaseException:
            self.close()
            raise
        if out.finished:
            self.close()
        return out

    def close(self) -> None:
        """Aborts the request if it is unfinished and forgets its queue (idempotent)."""
        if not self._done:
            self._done = True
            self._llm._release([self.request_id])

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_done", True):
            try:
                self.close()
            except Exception:   # interpreter shutdown: the engine may be gone
                pass
