"""Multi-host serving: the leader's engine inputs replayed step by step on follower processes.

Under multi-host tensor parallelism every process runs every jitted step (SPMD) on identical
host inputs, but only process 0 (the leader) serves. The engine below ``AsyncLLM`` is
deterministic given what enters it (the scheduler is a pure function, unseeded rows draw from
the engine seed folded by step, seeded rows from their own seed), so the leader sends what
enters its ``EngineCore``: each add (prompt, sampling params, id, priority, salt) and abort,
batched per step with a sequence number; each follower applies the batch to its own
``EngineCore`` and steps. Decisions taken from measured time would differ between processes,
so ``check_multihost`` refuses them.

Transport (pyzmq): the leader's XPUB sends pickled batches to the followers' SUB sockets, and
a leader heartbeat every ``timeout / 4`` s; each follower PUSHes a heartbeat at the same rate
(and its error, if its engine fails) to the leader's PULL. A peer silent for ``timeout`` s is
lost: the leader fails its requests and exits, a follower exits. The feed's addresses travel
through ``jax.distributed``'s key-value store. Both ends are processes of one deployment (as
jax's coordinator is): the feed is bound on the coordinator's interface.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable

try:
    import zmq
except ImportError as e:
    raise ImportError(f"multi-host serving needs pyzmq (pip install 'jaxkv[kv-events]'): {e}") \
        from None

from jaxkv.config import EngineConfig

logger = logging.getLogger("jaxkv.multihost")

FEED_KEY = "jaxkv/multihost/feed"
DEFAULT_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 300.0    # as jax.distributed.initialize's own
LOST_GRACE_S = 2.0           # a leader that lost a follower answers for this long, then exits
_HEARTBEAT, _STEP, _STOP, _ERROR = b"hb", b"step", b"stop", b"error"


class PeerLost(RuntimeError):
    """A process of the multi-host engine stopped answering or failed."""


def check_multihost(config: EngineConfig, timeout: float) -> None:
    """Refuses a non-positive ``timeout`` and the engine arguments whose decisions come from
    measured time (each process would measure its own and take different steps).

    Raises:
      ValueError: naming ``timeout``, ``preemption_mode`` (``"auto"`` with a host tier) or
        ``speculative_adaptive``.
    """
    if timeout <= 0:
        raise ValueError(f"peer_timeout={timeout} must be > 0 seconds (--peer-timeout)")
    if config.offload.kv_offload_bytes is not None and config.offload.preemption_mode == "auto":
        raise ValueError("multi-host serving needs preemption_mode='recompute' or 'swap' with "
                         "kv_offload_bytes: 'auto' chooses by the measured copy bandwidth and "
                         "prefill rate, which differ between processes")
    if config.speculative.speculative and config.speculative.speculative_adaptive:
        raise ValueError("multi-host serving needs speculative_adaptive=False: adaptive draft "
                         "lengths follow each process's measured step times")


# ---------------------------------------------------------------------- leader


class StepFeed:
    """The leader's end: records the adds and aborts applied to its engine and sends them,
    with the step they precede, to ``num_followers`` followers; watches their heartbeats.

    ``add`` / ``abort`` / ``step`` are called by ``AsyncLLM`` under its engine lock (the
    device thread's order is the order followers replay). A lost follower (silent for
    ``timeout`` s, or reporting its failure) calls ``on_lost(reason)`` once, from the watchdog
    thread, and makes later ``step`` calls raise ``PeerLost``.

    Args:
      host: the IP address to bind (the coordinator's).
      num_followers: how many followers subscribe before ``wait_for_followers`` returns.
      timeout: seconds of silence after which a follower is lost.
    """

    def __init__(self, host: str, num_followers: int, *, timeout: float = DEFAULT_TIMEOUT_S):
        self.num_followers, self.timeout = num_followers, timeout
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)           # XPUB: subscriptions are seen
        self._pub.setsockopt(zmq.SNDHWM, 0)    # never drop: SPMD keeps followers a step behind
        self._pull = self._ctx.socket(zmq.PULL)
        self.address = ",".join(f"tcp://{host}:{s.bind_to_random_port(f'tcp://{host}')}"
                                for s in (self._pub, self._pull))
        self._send_lock = threading.Lock()
        self._pending: list[tuple] = []        # ("add", request dict) / ("abort", request id)
        self._seq = 0
        self._lost: str | None = None
        self._on_lost: Callable[[str], None] = lambda reason: None
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def wait_for_followers(self, on_lost: Callable[[str], None],
                           within: float = STARTUP_TIMEOUT_S) -> None:
        """Blocks until every follower has subscribed, then starts the watchdog.

        Raises:
          PeerLost: not all subscribed within ``within`` seconds.
        """
        deadline, joined = time.monotonic() + within, 0
        while joined < self.num_followers:
            left = deadline - time.monotonic()
            if left <= 0 or not self._pub.poll(left * 1000):
                raise PeerLost(f"{joined} of {self.num_followers} followers joined the step "
                               f"feed {self.address} within {within:.0f} s")
            joined += self._pub.recv()[:1] == b"\x01"    # a subscription (not an unsubscribe)
        self._on_lost = on_lost
        self._watchdog = threading.Thread(target=self._watch, name="jaxkv-multihost",
                                          daemon=True)
        self._watchdog.start()

    def add(self, request: dict) -> None:
        """An ``EngineCore.add_request``'s keyword arguments, applied on the leader."""
        self._pending.append(("add", request))

    def abort(self, request_id: str) -> None:
        self._pending.append(("abort", request_id))

    def step(self) -> None:
        """Sends the adds and aborts since the last step, with the step they precede.

        Raises:
          PeerLost: a follower was lost (the leader must not step without it).
        """
        if self._lost is not None:
            raise PeerLost(self._lost)
        self._seq += 1
        batch, self._pending = self._pending, []
        self._send(_STEP, pickle.dumps((self._seq, batch), protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        """Tells the followers to stop (a normal shutdown) and closes the sockets."""
        if self._closed.is_set():
            return
        if self._lost is None:
            self._send(_STOP, b"")
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.join()
        self._pub.close(linger=1000)
        self._pull.close(linger=0)
        self._ctx.term()

    def _send(self, kind: bytes, body: bytes) -> None:
        with self._send_lock:
            self._pub.send_multipart([kind, body])

    def _watch(self) -> None:
        """Sends the leader's heartbeat and checks the followers' until closed or lost."""
        beat = self.timeout / 4
        next_beat = time.monotonic()
        # follower process id (processes 1..N) -> its last message (monotonic)
        last = {str(i).encode(): next_beat for i in range(1, self.num_followers + 1)}
        while not self._closed.is_set() and self._lost is None:
            if time.monotonic() >= next_beat:
                self._send(_HEARTBEAT, b"")
                next_beat = time.monotonic() + beat
            if self._pull.poll(beat * 1000):
                while self._pull.poll(0):
                    pid, kind, text = self._pull.recv_multipart()
                    last[pid] = time.monotonic()
                    if kind == _ERROR:
                        self._lose(f"follower {pid.decode()} failed: {text.decode()}")
            now = time.monotonic()
            silent = [p.decode() for p, t in last.items() if now - t > self.timeout]
            if silent:
                self._lose(f"follower(s) {', '.join(silent)} sent no heartbeat for "
                           f"{self.timeout:.1f} s")

    def _lose(self, reason: str) -> None:
        if self._lost is None:
            self._lost = reason
            logger.error("multi-host engine lost a process: %s", reason)
            self._on_lost(reason)


def launch(config: EngineConfig, *, coordinator_address: str | None, num_processes: int | None,
           process_id: int | None, peer_timeout: float) -> bool:
    """A serving process's start: checks ``config`` and joins ``jax.distributed``. The leader
    (process 0) gets True and serves (``open_leader_feed``); a follower replays until the
    leader stops it (``run_follower``), then gets False.

    Raises:
      ValueError: ``check_multihost``'s, before anything starts.
    """
    import jax

    from jaxkv.runner.sharding import initialize_distributed

    check_multihost(config, peer_timeout)
    initialize_distributed(coordinator_address, num_processes, process_id)
    if jax.process_index() == 0:
        return True
    run_follower(config, timeout=peer_timeout)
    return False


def coordinator_host() -> str:
    """The IP address of ``jax.distributed``'s coordinator (where process 0 runs)."""
    from jax._src.distributed import global_state

    return socket.gethostbyname(global_state.coordinator_address.rsplit(":", 1)[0])


def _kv_client():
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("multi-host serving needs jax.distributed.initialize first")
    return global_state.client


def open_leader_feed(timeout: float = DEFAULT_TIMEOUT_S) -> StepFeed:
    """The leader's ``StepFeed`` over ``jax.distributed``'s processes, its address published
    in the coordinator's key-value store (``wait_for_followers`` is the caller's next call)."""
    import jax

    feed = StepFeed(coordinator_host(), jax.process_count() - 1, timeout=timeout)
    _kv_client().key_value_set(FEED_KEY, feed.address)
    return feed


def start_leader(feed: StepFeed, **engine_kwargs):
    """The leader's ``AsyncLLM`` over ``engine_kwargs`` (which ``launch`` checked), once every
    follower has joined ``feed``. A lost follower fails every request with ``EngineDeadError``
    (a server's 503) and, ``LOST_GRACE_S`` later (the answers go out), ends the process with
    status 1; ``AsyncLLM.shutdown`` stops the followers.

    Raises:
      TypeError, ValueError: a bad engine argument.
      PeerLost: not every follower joined in time.
    """
    from jaxkv.engine.async_llm import AsyncLLM, EngineDeadError

    engines = []

    def lost(reason: str) -> None:
        for engine in engines:
            engine.fail(EngineDeadError(f"a process of the multi-host engine was lost: {reason}"))
        threading.Timer(LOST_GRACE_S, exit_process, (1,)).start()

    feed.wait_for_followers(lost)
    engines.append(AsyncLLM(**engine_kwargs, step_feed=feed))
    return engines[0]


# ---------------------------------------------------------------------- follower


class FollowerLink:
    """A follower's end: the leader's batches in, this process's heartbeat out.

    Args:
      address: ``StepFeed.address``.
      process_id: this process's rank (named in the leader's messages).
      timeout: seconds of the leader's silence after which it is lost.
      on_leader_gone: called from the heartbeat thread when the leader's connection has been
        down for ``timeout`` s while this link is open (the main thread may be inside a step
        whose collective never ends, so ``next_batch`` would not notice).
    """

    def __init__(self, address: str, process_id: int, *, timeout: float = DEFAULT_TIMEOUT_S,
                 on_leader_gone: Callable[[], None] = lambda: None):
        feed, beats = address.split(",")
        self.timeout, self._pid = timeout, str(process_id).encode()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED
                                                     | zmq.EVENT_DISCONNECTED)
        self._sub.connect(feed)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(beats)
        self._push_lock = threading.Lock()
        self._seq = 0
        self._on_leader_gone = on_leader_gone
        self._closed = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="jaxkv-multihost",
                                      daemon=True)
        self._beat.start()

    def next_batch(self) -> list[tuple] | None:
        """The next step's adds and aborts (blocks); None when the leader says stop.

        Raises:
          PeerLost: the leader was silent for ``timeout`` s, or a batch is missing.
        """
        while True:
            if not self._sub.poll(self.timeout * 1000):
                raise PeerLost(f"the leader sent nothing for {self.timeout:.1f} s")
            kind, body = self._sub.recv_multipart()
            if kind == _STOP:
                return None
            if kind == _STEP:
                seq, batch = pickle.loads(body)
                if seq != self._seq + 1:
                    raise PeerLost(f"step batch {seq} came after {self._seq}: batches were lost")
                self._seq = seq
                return batch

    def report(self, error: BaseException) -> None:
        """Tells the leader this follower failed (it fails its requests at once)."""
        self._send(_ERROR, repr(error).encode())

    def close(self) -> None:
        self._closed.set()
        self._beat.join()
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._push.close(linger=1000)
        self._ctx.term()

    def _send(self, kind: bytes, text: bytes = b"") -> None:
        with self._push_lock:
            self._push.send_multipart([self._pid, kind, text])

    def _heartbeat(self) -> None:
        """Sends this follower's heartbeat; watches the leader's connection."""
        from zmq.utils.monitor import recv_monitor_message

        down_since = None
        while not self._closed.wait(self.timeout / 4):
            self._send(_HEARTBEAT)
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)["event"]
                down_since = time.monotonic() if event == zmq.EVENT_DISCONNECTED else None
            if down_since is not None and time.monotonic() - down_since > self.timeout:
                self._on_leader_gone()
                return


def replay(engine, link: FollowerLink) -> None:
    """Applies the leader's batches to ``engine`` (an ``EngineCore``) and steps it after each,
    until the leader says stop."""
    while (batch := link.next_batch()) is not None:
        for kind, arg in batch:
            if kind == "add":
                engine.add_request(**arg)
            else:
                engine.abort_request(arg)
        engine.step()


def exit_process(status: int) -> None:
    """Ends this process at once, logs flushed: after a peer is lost, jax's shutdown barrier
    (and a step stuck in a collective) would wait for it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_follower(config: EngineConfig, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """A follower process's life: joins the leader's feed (its address from the key-value
    store), builds the same engine (without KV-cache events: the leader publishes them) and
    replays until the leader says stop. A lost leader or a failing engine is reported to the
    leader, logged, and ends the process with status 1 (``exit_process``)."""
    import dataclasses

    import jax

    from jaxkv.config.args import KVEventsArgs
    from jaxkv.engine.core import EngineCore

    address = _kv_client().blocking_key_value_get(FEED_KEY, int(STARTUP_TIMEOUT_S * 1000))

    def leader_gone():
        logger.error("the leader's connection has been down for %.1f s", timeout)
        exit_process(1)

    link = FollowerLink(address, jax.process_index(), timeout=timeout,
                        on_leader_gone=leader_gone)
    try:
        engine = EngineCore(dataclasses.replace(config, kv_events=KVEventsArgs()))
        replay(engine, link)
    except BaseException as e:
        logger.exception("follower %d stops", jax.process_index())
        link.report(e)
        link.close()       # the report goes out first (linger)
        exit_process(1)
    engine.close()
    link.close()
