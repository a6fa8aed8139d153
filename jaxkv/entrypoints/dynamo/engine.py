"""``JaxkvEngine``: jaxkv as an NVIDIA Dynamo backend (Dynamo's unified Python ``LLMEngine``).

Dynamo's Rust ``Worker`` owns discovery, the request plane, cancellation and shutdown; this
class runs one ``AsyncLLM`` (its device thread is the only step loop) and answers Dynamo's
lifecycle: ``start`` loads the engine and returns the registration (block size, blocks,
context), ``generate`` streams token deltas, ``abort`` frees a request's blocks, ``cleanup``
frees the engine. The KV router subscribes to the engine's own KV-cache events
(``kv_events_config``, vLLM's ZMQ wire format); load snapshots are pushed after engine
outputs; the ``vllm:`` / ``jaxkv:`` metrics are bridged into the worker's ``/metrics``.

Design notes: docs/dynamo.md.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import AsyncGenerator

from jaxkv.entrypoints.dynamo import require_dynamo

require_dynamo()

from dynamo.common.backend.engine import (  # noqa: E402
    EngineConfig as DynamoEngineConfig,
    LLMEngine,
    LlmRegistration,
)
from dynamo.common.backend.metrics import register_engine_registry  # noqa: E402
from dynamo.common.backend.publisher import ComponentSnapshot, ZmqSource  # noqa: E402
from dynamo.common.utils.token_ids import normalize_request_token_ids  # noqa: E402
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument  # noqa: E402

from jaxkv.entrypoints.dynamo import args as dynamo_args  # noqa: E402
from jaxkv.entrypoints.dynamo import model_card, protocol  # noqa: E402
from jaxkv.model import store  # noqa: E402

logger = logging.getLogger("jaxkv.dynamo")

SNAPSHOT_INTERVAL_S = 0.05   # at most one load snapshot per this many seconds


class JaxkvEngine(LLMEngine):
    """One jaxkv ``AsyncLLM`` behind Dynamo's ``Worker``.

    Args:
      config: the jaxkv ``EngineConfig`` (engine flags).
      served_model_name: the model name clients send.
      step_feed: multi-host: the leader's ``jaxkv.engine.multihost.StepFeed`` (None: one
        process).
    """

    def __init__(self, config, served_model_name: str, step_feed=None):
        self.config = config
        self.served_model_name = served_model_name
        self.step_feed = step_feed
        self.llm = None
        self.metrics = None
        self.max_model_len = 0
        # the KV events' ipc socket lives here; removed by cleanup(), or at exit
        self._tmp = tempfile.mkdtemp(prefix="jaxkv-dynamo-")
        self._remove_tmp = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        # the model files Dynamo registers (written by start() unless an HF directory)
        model_path = store.resolve(config.model.model)
        self.card = (model_path if model_card.is_hf_dir(model_path) else model_card.card_path(
            model_path, config.scheduler.max_model_len))
        self._kv_source: ZmqSource | None = None
        self._snapshots: SnapshotPusher | None = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None):
        """Parses Dynamo's runtime flags and jaxkv's engine flags (``args.parse``)."""
        parsed = dynamo_args.parse(argv)
        feed = None
        if parsed.launch is not None:   # __main__ joined jax.distributed as process 0
            from jaxkv.engine.multihost import open_leader_feed

            feed = open_leader_feed(parsed.launch["peer_timeout"])
        engine = cls(parsed.engine, parsed.served_model_name, feed)
        return engine, parsed.worker_config(engine.card)

    async def start(self, worker_id: int) -> DynamoEngineConfig:
        """Loads the engine (in a thread: the event loop keeps running) and returns what
        Dynamo registers: the model files, block size and count, context and batch limits."""
        from jaxkv.engine.async_llm import AsyncLLM, freeze_gc_heap
        from jaxkv.server.metrics import ServerMetrics

        del worker_id
        kwargs = self.config.to_kwargs()
        kwargs["kv_events_config"], self._kv_source = kv_events(
            kwargs["kv_events_config"], self._tmp)
        if self.step_feed is None:
            self.llm = await asyncio.to_thread(AsyncLLM, **kwargs)
        else:
            from jaxkv.engine.multihost import start_leader

            self.llm = await asyncio.to_thread(start_leader, self.step_feed, **kwargs)
        core = self.llm.engine
        self.max_model_len = core.sched_config.max_model_len
        self.metrics = ServerMetrics(self.served_model_name, self.llm.stats_now)
        if not model_card.is_hf_dir(self.card):
            await asyncio.to_thread(model_card.write_card, core.tokenizer, core.model_config,
                                    self.max_model_len, self.card)
        cache = core.cache_config
        logger.info("jaxkv engine ready: %d blocks of %d tokens, max_model_len %d, model "
                    "files %s", cache.num_usable_blocks, cache.block_size, self.max_model_len,
                    self.card)
        freeze_gc_heap()
        return DynamoEngineConfig(
            model=str(self.card), served_model_name=self.served_model_name,
            llm=LlmRegistration(
                context_length=self.max_model_len, kv_cache_block_size=cache.block_size,
                total_kv_blocks=cache.num_usable_blocks,
                max_num_seqs=core.sched_config.max_num_seqs,
                max_num_batched_tokens=core.sched_config.max_num_batched_tokens))

    async def kv_event_sources(self):
        """The engine's ZMQ PUB socket, which Dynamo's worker relays to the KV router."""
        return [] if self._kv_source is None else [self._kv_source]

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher) -> None:
        self._snapshots = SnapshotPusher(publisher, self.llm.stats_now)
        self._snapshots.poke()

    async def register_prometheus(self, metrics) -> None:
        """Bridges the ``vllm:`` / ``jaxkv:`` metrics (jaxkv/server/metrics.py) into the
        worker's ``/metrics``."""
        register_engine_registry(metrics, self.metrics.registry,
                                 prefix_filters=["vllm:", "jaxkv:"])

    async def generate(self, request, context) -> AsyncGenerator[dict, None]:
        """Streams one request's new tokens, chunk by chunk; the last chunk carries
        ``finish_reason`` and ``completion_usage``."""
        if self.llm is None:
            raise EngineShutdown("the jaxkv engine is not running")
        normalize_request_token_ids(request)
        prompt = request["token_ids"]
        try:
            params = protocol.sampling_params(request, self.max_model_len)
            stream = await self.llm.add_request({"prompt_token_ids": list(prompt)}, params,
                                                request_id=context.id())
        except (TypeError, ValueError) as e:
            raise InvalidArgument(str(e)) from None
        writer = protocol.ChunkWriter(self.llm.tokenizer, params.logprobs or 0)
        previous = None
        try:
            async for out in stream:
                self._observe(previous, out)
                previous = out
                chunk = writer.chunk(out)
                if chunk is not None:
                    yield chunk
                if context.is_stopped() and not out.finished:
                    yield protocol.cancelled_chunk(len(prompt), writer.sent)
                    return
        finally:
            if not stream.finished:
                stream.abort()
                self.metrics.observe_aborted()
            if self._snapshots is not None:
                self._snapshots.poke()

    def _observe(self, previous, out) -> None:
        self.metrics.observe_step(previous, out)
        if out.finished:
            self.metrics.observe_finished(out)
        if self._snapshots is not None:
            self._snapshots.poke()

    async def abort(self, context) -> None:
        """Frees a cancelled request's blocks before the engine's next step."""
        if self.llm is not None and context.id() is not None:
            await self.llm.abort(context.id())

    async def cleanup(self) -> None:
        """Stops the snapshot thread and the engine, removes the temporary files (null-safe,
        idempotent)."""
        snapshots, self._snapshots = self._snapshots, None
        if snapshots is not None:
            snapshots.stop()
        llm, self.llm = self.llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
            logger.info("jaxkv engine shut down")
        self._remove_tmp()


def kv_events(value: dict | None, tmp: str) -> tuple[dict | None, ZmqSource | None]:
    """The engine's ``kv_events_config`` and the source Dynamo subscribes to.

    Default: events on, on an ipc socket in ``tmp``. A given config is kept; its endpoint
    must be one the engine binds (``tcp://*:PORT`` or ``ipc://``) for Dynamo to subscribe, or
    the router goes without events (it then predicts the caches from its own decisions).
    """
    if value is None:
        value = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/kv-events"}
    if not value.get("enable_kv_cache_events") or value.get("publisher") == "null":
        return value, None
    endpoint = value.get("endpoint", "tcp://*:5557")
    for wildcard, local in (("tcp://*:", "tcp://127.0.0.1:"), ("tcp://[::]:", "tcp://[::1]:")):
        endpoint = endpoint.replace(wildcard, local, 1)
    if not endpoint.startswith(("tcp://127.0.0.1:", "tcp://[::1]:", "ipc://")):
        logger.warning("kv_events_config.endpoint %s is not one this worker binds: the KV "
                       "router gets no events from it", value["endpoint"])
        return value, None
    return value, ZmqSource(endpoint=endpoint, topic=value.get("topic", ""), dp_rank=0)


class SnapshotPusher:
    """Pushes Dynamo's per-worker load snapshot (``ComponentSnapshot``: used and total
    blocks, usage, prefix-cache hit rate) after engine outputs, from its own thread (the
    stats wait for a running step), at most every ``SNAPSHOT_INTERVAL_S``."""

    def __init__(self, publisher, stats):
        self._publisher, self._stats = publisher, stats
        self._wake, self._stopping = threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="jaxkv-dynamo-load", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Something changed: push a snapshot soon."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._stopping:
                return
            self._wake.clear()
            try:
                self._publisher.publish(0, snapshot(self._stats()))
            except Exception:   # the engine shut down under it, or the runtime is gone
                logger.debug("load snapshot not published", exc_info=True)
            time.sleep(SNAPSHOT_INTERVAL_S)


def snapshot(s: dict) -> ComponentSnapshot:
    """``EngineCore.stats()`` as Dynamo's ``ComponentSnapshot``."""
    return ComponentSnapshot(
        kv_used_blocks=s["kv_blocks_used"], kv_total_blocks=s["kv_blocks_total"],
        gpu_cache_usage=s["kv_usage"], dp_rank=0,
        kv_cache_hit_rate=s["prefix_cache_hit_rate"] if s["prefix_cache_queries"] else None)
