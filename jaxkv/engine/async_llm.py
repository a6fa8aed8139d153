"""AsyncLLM: the asyncio facade over ``EngineCore`` (vLLM's ``AsyncLLM`` shape).

Design notes: docs/engine.md."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections import deque
from collections.abc import AsyncIterator

from jaxkv.config import EngineConfig, describe_arguments
from jaxkv.engine.core import EngineCore
from jaxkv.engine.outputs import RequestOutput
from jaxkv.sample.sampler import SamplingParams


class EngineDeadError(RuntimeError):
    """The device loop failed or was shut down; the engine takes no more requests."""


def freeze_gc_heap() -> None:
    """Moves everything alive now (modules, weights' pytrees, compiled executables) to the
    collector's permanent generation, as vLLM's server does once its engine is up: a full
    collection while serving then scans only what serving allocated. Unfrozen, one took
    0.3-0.4 s of a tiny model's server (all threads, the event loop included, wait on it).
    For processes that serve; ``LLM`` leaves the collector of a user's process alone."""
    gc.collect()
    gc.freeze()


class AsyncLLM:
    """An asyncio engine: ``async for out in engine.generate(...)``.

    Args:
      model: as for ``LLM``.
      step_feed: multi-host serving's leader end (``jaxkv.engine.multihost.StepFeed``): every
        add and abort applied to the engine, and every step, are sent to the followers.
      **kwargs: the engine arguments of ``LLM`` (``EngineConfig.from_kwargs``), listed below.

    Raises:
      TypeError, ValueError: naming a bad engine argument (in the constructor, before the
        device thread starts).

    Engine arguments:
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", *, step_feed=None, **kwargs):
        self.engine = EngineCore(EngineConfig.from_kwargs(model=model, **kwargs))
        self._feed = step_feed
        self._lock = threading.Lock()                 # guards the engine and the queues
        self._wake = threading.Condition(self._lock)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._aborts: deque[str] = deque()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jaxkv-device", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ device thread

    def _loop(self) -> None:
        """The device loop: steps while there is work, sleeps on the condition otherwise."""
        while True:
            with self._wake:
                while not self._stopping and not self._aborts \
                        and not self.engine.has_unfinished_requests():
                    self._wake.wait()
                if self._stopping:
                    return
                while self._aborts:
                    rid = self._aborts.popleft()
                    if self.engine.is_live(rid):
                        self.engine.abort_request(rid)
                        if self._feed is not None:
                            self._feed.abort(rid)
                try:
                    outputs = self._step() if self.engine.has_unfinished_requests() else {}
                except BaseException as e:   # nothing to blame one request for: fail them all
                    self._error = e
                    for loop, queue in self._queues.values():
                        _deliver(loop, queue, e)
                    self._queues.clear()
                    return
                routes = [(self._queues.get(rid), out) for rid, out in outputs.items()]
                for rid, out in outputs.items():
                    if out.finished:
                        self._queues.pop(rid, None)
            for route, out in routes:
                if route is not None:
                    _deliver(*route, out)

    def _step(self) -> dict:
        if self._feed is not None:
            self._feed.step()
        return self.engine.step()

    # ------------------------------------------------------------------ requests

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}") from self._error
        if self._stopping:
            raise EngineDeadError("the engine was shut down")

    def _add(self, loop, queue, prompt, sampling_params, request_id, priority,
             cache_salt) -> str:
        spec = getattr(sampling_params, "structured_outputs", None)
        if spec is not None:   # compiled here, not under the lock the engine loop steps in
            self.engine.compile_structured_outputs(spec)
        self._check_alive()    # failed (``fail``): the device thread may never free the lock
        with self._wake:
            self._check_alive()
            rid = self.engine.add_request(prompt, sampling_params, request_id=request_id,
                                          priority=priority, cache_salt=cache_salt)
            if self._feed is not None:
                self._feed.add(dict(prompt=prompt, sampling_params=sampling_params,
                                    request_id=rid, priority=priority, cache_salt=cache_salt))
            self._queues[rid] = (loop, queue)
            self._wake.notify()
            return rid

    async def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, *, priority: int = 0,
                          cache_salt: str | None = None) -> "AsyncRequestStream":
        """Queues one request and returns the async iterator of its outputs (a server
        validates here, before it answers, and streams afterwards).

        Args:
          prompt: a str or ``{"prompt_token_ids": [...]}``.
          sampling_params: default ``SamplingParams()``.
          request_id: a str unique among live requests (default: a fresh number).
          priority, cache_salt: as for ``LLM.generate``.

        Raises:
          TypeError, ValueError: naming the bad field; nothing is queued then.
          EngineDeadError: the engine loop failed or was shut down.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        added = asyncio.ensure_future(asyncio.to_thread(
            self._add, loop, queue, prompt, sampling_params, request_id, priority, cache_salt))
        try:
            rid = await asyncio.shield(added)
        except asyncio.CancelledError:   # the add still lands in its thread: undo it then
            added.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                    or self._abort_soon(f.result()))
            raise
        return AsyncRequestStream(self, rid, queue)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Generates one prompt, yielding its ``RequestOutput`` after every step that adds
        tokens; the last one is finished. Arguments and errors as for ``add_request``; a
        cancelled or closed generator aborts its request."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority=priority,
                                        cache_salt=cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def _abort_soon(self, request_id: str) -> None:
        """Has the device thread abort ``request_id`` before its next step (never blocks)."""
        self._aborts.append(request_id)
        if self._lock.acquire(blocking=False):   # wake it if it sleeps; else it is stepping
            try:
                self._wake.notify()
            finally:
                self._lock.release()

    async def abort(self, request_id: str) -> None:
        """Aborts a queued or running request: its blocks are freed before the next step and
        its generator ends with a finished output (``finish_reason="abort"``)."""
        self._abort_soon(request_id)

    async def stats(self) -> dict:
        """``EngineCore.stats()``, read under the engine lock (in a worker thread)."""
        return await asyncio.to_thread(self.stats_now)

    def stats_now(self) -> dict:
        """``EngineCore.stats()`` from a plain thread (waits for a running step to end)."""
        with self._lock:
            return self.engine.stats()

    def fail(self, error: EngineDeadError) -> None:
        """Fails every in-flight request with ``error`` and refuses new ones, without the
        engine lock (multi-host: a lost process leaves the device thread inside a step whose
        collective may never end). The process is expected to exit; ``shutdown`` would wait
        for that step."""
        self._error = error
        for loop, queue in list(self._queues.values()):
            _deliver(loop, queue, error)

    def shutdown(self) -> None:
        """Stops the device loop (in-flight requests get ``EngineDeadError``) and frees the
        device memory. Idempotent."""
        with self._wake:
            if self._stopping:
                return
            self._stopping = True
            self._wake.notify()
            for loop, queue in self._queues.values():
                _deliver(loop, queue, EngineDeadError(
                    "the engine was shut down before this request finished"))
            self._queues.clear()
        self._thread.join()
        if self._feed is not None:   # multi-host: the followers stop too
            self._feed.close()
        self.engine.close()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)


AsyncLLM.__doc__ += describe_arguments(indent=6)


class AsyncRequestStream(AsyncIterator[RequestOutput]):
    """The outputs of one ``AsyncLLM`` request, step by step (``AsyncLLM.add_request``).

    ``__anext__`` waits for the next output; after the finished one it stops. ``abort`` (or
    ``aclose``) aborts an unfinished request: its blocks are freed before the next step.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue):
        self._engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._queue.get()
        if isinstance(out, EngineDeadError):   # shut down with this request in flight
            self.finished = True
            raise out
        if isinstance(out, BaseException):
            self.finished = True
            raise EngineDeadError(f"the engine loop failed: {out!r}") from out
        self.finished = out.finished
        return out

    def abort(self) -> None:
        """Aborts the request unless it finished (idempotent, never blocks)."""
        if not self.finished:
            self.finished = True
            self._engine._abort_soon(self.request_id)

    async def aclose(self) -> None:
        self.abort()


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
    """Puts ``item`` into a coroutine's queue from the device thread (dropped if its event
    loop is closed: nobody is waiting any more)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:
        pass
