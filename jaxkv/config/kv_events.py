"""``KVEventsConfig``: vLLM's KV-cache events settings (the ``kv_events_config`` engine argument,
``--kv-events-config '{json}'``), checked field by field, plus the event encoding.

Design notes: docs/server.md (KV-cache events)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json

from jaxkv.config.options import check_fields, option

PUBLISHERS = ("zmq", "null")
# "array": each event a tagged array (msgspec array_like: vLLM before 0.34, what llm-d reads);
# "map": a tagged map (vLLM 0.34). Dynamo reads both.
ENCODINGS = ("array", "map")
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """Where and how the engine publishes its KV-cache events (vLLM's fields, then jaxkv's)."""

    enable_kv_cache_events: bool = option(False, "publish BlockStored / BlockRemoved / "
                                          "AllBlocksCleared events")
    publisher: str | None = option(None, "zmq or null (default: zmq when enabled)",
                                   choices=PUBLISHERS)
    endpoint: str = option("tcp://*:5557", "the PUB socket: bound when it holds *, :: or is "
                           "ipc:// or inproc://, else connected to")
    replay_endpoint: str | None = option(None, "a ROUTER socket (bound) replaying buffered "
                                         "batches from a sequence number")
    buffer_steps: int = option(10_000, "batches kept for replay", minimum=1)
    hwm: int = option(100_000, "the PUB socket's send high-water mark (messages)", minimum=0)
    max_queue_size: int = option(100_000, "batches waiting for the publisher thread; a batch "
                                 "that finds it full is dropped and counted", minimum=1)
    topic: str = option("", "the first frame of every message (llm-d: kv@<pod>@<model>)")
    encoding: str = option("array", "event encoding: array (tagged arrays: llm-d and Dynamo) "
                           "or map (tagged maps, vLLM 0.34: Dynamo)", choices=ENCODINGS)
    data_parallel_rank: int = option(0, "the replica's rank: in every batch, and added to "
                                     "the tcp ports (DataParallelLLM sets it)", minimum=0)

    def __post_init__(self):
        try:
            check_fields(self)
            if self.publisher is None:
                object.__setattr__(self, "publisher",
                                   "zmq" if self.enable_kv_cache_events else "null")
            for name in ("endpoint", "replay_endpoint"):
                value = getattr(self, name)
                if value is not None and not value.startswith(ZMQ_SCHEMES):
                    raise ValueError(f"{name}={value!r} is not a ZMQ endpoint "
                                     f"({', '.join(ZMQ_SCHEMES)})")
        except (TypeError, ValueError) as e:
            e.args = (f"kv_events_config.{e}",)
            raise

    @property
    def enabled(self) -> bool:
        """Whether events are recorded and published."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def of(cls, value) -> KVEventsConfig | None:
        """The config of a ``kv_events_config`` argument: None, a dict of fields or a
        ``KVEventsConfig``.

        Raises:
          ValueError: an unknown field (with the closest names) or a bad value, naming
            ``kv_events_config.<field>``; a ``ParamTypeError`` (also a ``ValueError``) for
            a value of the wrong type.
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config={value!r} is not a dict of KVEventsConfig "
                             f"fields")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=2)
                raise ValueError(f"kv_events_config has no field {key!r}"
                                 + (f"; did you mean {', '.join(close)}?" if close else ""))
        return cls(**value)

    def for_rank(self, rank: int) -> KVEventsConfig:
        """This config for data-parallel replica ``rank``: tcp ports + ``rank``, inproc names
        + ``_dp<rank>`` (as vLLM; ipc paths are left as they are: give replicas their own)."""
        return dataclasses.replace(self, endpoint=_offset(self.endpoint, rank),
                                   replay_endpoint=_offset(self.replay_endpoint, rank),
                                   data_parallel_rank=rank)


def _offset(endpoint: str | None, rank: int) -> str | None:
    """``endpoint`` for replica ``rank`` (see ``KVEventsConfig.for_rank``)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}" if port.isdigit() and port != "0" else endpoint
    return endpoint


def parse_json(text: str) -> dict:
    """``'{"enable_kv_cache_events": true}'`` -> a dict (the CLI flag's parser)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value
