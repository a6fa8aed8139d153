"""ZmqEventPublisher: KV-cache event batches over ZeroMQ as vLLM's ``ZmqEventPublisher`` sends
them, from a thread of its own behind a bounded queue, so an engine step never waits.

    PUB      [topic, seq (8 bytes, big-endian), msgpack batch]      one message per batch
    ROUTER   request  [identity, b"", start seq (8 bytes, big-endian)]
             replies  [identity, b"", topic, seq, batch]  per buffered batch with seq >= start,
                      then [identity, b"", b"", -1 (8 bytes, signed), b""]   the end marker

Sequence numbers count batches from 0 in the order the engine hands them in; a batch that finds
the queue full is dropped (``num_dropped``) and leaves a gap, so subscribers see the loss.
Design notes: docs/server.md (KV-cache events)."""

from __future__ import annotations

import collections
import logging
import queue
import threading

import zmq

from jaxkv.config.kv_events import KVEventsConfig
from jaxkv.engine.kv_event_wire import Wire

logger = logging.getLogger("jaxkv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """The sockets of ``config`` (bound or connected here, in the caller's thread, so a bad
    endpoint raises at once) and the thread that sends on them.

    Attributes:
      endpoint, replay_endpoint: where the sockets are (a bound ``tcp://*:0``: its port).
      num_published: batches queued; ``num_dropped``: batches dropped, the queue full;
      ``num_sent``: batches sent (the thread's count).
    """

    def __init__(self, config: KVEventsConfig, wire: Wire):
        self.config, self.wire = config, wire
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._socket(zmq.PUB, "endpoint", config.endpoint, config.hwm)
        self.endpoint = self._where(self._pub, config.endpoint)
        self._replay = self.replay_endpoint = None
        if config.replay_endpoint is not None:
            self._replay = self._socket(zmq.ROUTER, "replay_endpoint", config.replay_endpoint,
                                        2 * (config.buffer_steps + 1), bind=True)
            self.replay_endpoint = self._where(self._replay, config.replay_endpoint)
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque = collections.deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.num_published = self.num_dropped = self.num_sent = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="jaxkv-kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, field: str, endpoint: str, hwm: int, bind: bool = False):
        """A socket bound to ``endpoint`` (vLLM's rule: ``*``, ``::``, ipc, inproc, or
        ``bind``), else connected to it.

        Raises:
          ValueError: naming ``kv_events_config.<field>`` and ZeroMQ's reason.
        """
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.LINGER, 1000)   # ms a close waits for messages still queued
        try:
            if bind or "*" in endpoint or "::" in endpoint or endpoint.startswith(
                    ("ipc://", "inproc://")):
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ValueError(f"kv_events_config.{field}={endpoint!r}: {e}") from None
        return sock

    @staticmethod
    def _where(sock, endpoint: str) -> str:
        """The endpoint a bound socket reports (a wildcard port resolved), else ``endpoint``."""
        last = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return last or endpoint

    def publish(self, ts: float, events: list) -> bool:
        """Queues one batch of ``events`` (never blocks). Returns False when it was dropped."""
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._queue.put_nowait((seq, ts, events))
        except queue.Full:
            self.num_dropped += 1
            return False
        self.num_published += 1
        return True

    def _run(self) -> None:
        """The thread: send queued batches, answer replay requests, until closed and drained."""
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                if self._closing:
                    return
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = self.wire.encode(ts, events, self.config.data_parallel_rank)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:   # one bad batch must not stop the thread
                logger.exception("KV events: batch %d not sent", seq)
                continue
            self._buffer.append((seq, payload))
            self.num_sent += 1

    def _serve_replay(self) -> None:
        """Answers one replay request: the buffered batches from its sequence number on, then
        the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued (within ``timeout`` seconds), then closes the sockets."""
        if self._closing:
            return
        self._closing = True
        try:
            self._queue.put_nowait(None)
        except queue.Full:   # the thread ends once it has drained the queue
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: %d batches unsent at close", self._queue.qsize())
            return   # the thread still owns the sockets; they go with the process
        self._pub.close()
        if self._replay is not None:
            self._replay.close(linger=0)

