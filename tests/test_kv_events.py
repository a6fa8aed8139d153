"""KV-cache events in vLLM's wire format (jaxkv/blocks/kv_events.py, jaxkv/engine/kv_event_*.py)
and the gauges llm-d scrapes, against independent references: the wire bytes decoded with
msgspec structs written here from vLLM's spec (both encodings), a live ZMQ subscriber on a real
engine run, block hashes recomputed here from the token ids, and a router-style index built
from the events alone that must equal what the engine's device pool, host tier and disk hold.
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import settings, strategies as st
from hypothesis.stateful import initialize
from prometheus_client.parser import text_string_to_metric_families

from jaxkv import LLM, SamplingParams
from jaxkv.blocks.block_manager import BlockManager
from jaxkv.blocks.host_tier import SwapCostModel
from jaxkv.blocks.kv_events import CPU, GPU, Cleared, Origin, Removed, Stored
from jaxkv.blocks.prefix_cache import group_key
from jaxkv.config import EngineConfig
from jaxkv.config.kv_events import KVEventsConfig
from jaxkv.engine.kv_event_publisher import ZmqEventPublisher
from jaxkv.engine.kv_event_tracker import KVEventTracker
from jaxkv.engine.kv_event_wire import Wire
from jaxkv.sched.state import init_state, with_cost_model
from jaxkv.server.metrics import ServerMetrics
from test_offload import TieredMachine
from tiny_models import TINY_ENGINE

MASK = (1 << 64) - 1
BS = TINY_ENGINE["block_size"]
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


# ------------------------------------------------ vLLM's structs, from its spec (0.32 - 0.34)

class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class AStored(ArrayEvent, tag="BlockStored"):   # llm-d's msgpackVLLMBlockStoredEvent
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ARemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ACleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class MapEvent(msgspec.Struct, omit_defaults=True, tag=True, forbid_unknown_fields=True):
    pass


class MStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class MRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class MCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[AStored | ARemoved | ACleared]
    data_parallel_rank: int | None = None


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[MStored | MRemoved | MCleared]
    data_parallel_rank: int | None = None


DECODERS = {"array": msgspec.msgpack.Decoder(ArrayBatch), "map": msgspec.msgpack.Decoder(MapBatch)}
# llm-d decodes an array-encoded struct only when the array has exactly its fields (the Go
# msgpack decoder's errArrayStruct), msgspec also when it is longer: the lengths are checked too
LENGTHS = {"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}


def check_array_lengths(payload: bytes) -> None:
    batch = msgspec.msgpack.decode(payload)
    assert len(batch) == 3
    for event in batch[1]:
        assert len(event) == LENGTHS[event[0]], event


# ------------------------------------------------ the hash chain, recomputed here

def root(salt) -> int:
    digest = hashlib.blake2b(repr(("jaxkv-prefix-root", salt)).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


def signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def chain(tokens, salt=None) -> list[int]:
    """The published hashes of ``tokens``' full blocks."""
    key, out = root(salt), []
    for j in range(len(tokens) // BS):
        key = hash((key, tuple(tokens[j * BS:(j + 1) * BS])))
        out.append(key & MASK)
    return out


def check_chained(event, salt_of_first=None):
    """Each hash of a BlockStored is the hash of (its parent, its tokens)."""
    parent = root(salt_of_first) if event.parent_block_hash is None else signed(
        event.parent_block_hash)
    for i, h in enumerate(event.block_hashes):
        parent = hash((parent, tuple(event.token_ids[i * BS:(i + 1) * BS])))
        assert parent & MASK == h


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + j * 11) % 383 + 5 for j in range(n)]


# ------------------------------------------------ a subscriber and a replay client

class Subscriber:
    def __init__(self, endpoint: str, encoding: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = DECODERS[encoding]
        time.sleep(0.3)   # the subscription reaches the PUB socket

    def take(self, quiet: float = 0.5) -> list[tuple[bytes, int, bytes]]:
        out = []
        while self.sock.poll(int(quiet * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            if self.decoder is DECODERS["array"]:
                check_array_lengths(payload)
            out.append((topic, int.from_bytes(seq, "big"), payload))
        return out

    def events(self, messages):
        return [e for _, _, p in messages for e in self.decoder.decode(p).events]

    def close(self):
        self.sock.close(linger=0)


def replay(endpoint: str, start: int) -> list[tuple[bytes, int, bytes]]:
    """vLLM's replay protocol: [b"", start] to the ROUTER, then (b"", topic, seq, payload) per
    batch and the end marker (b"", b"", -1, b"")."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    try:
        while True:
            assert sock.poll(5000), "no replay reply"
            frames = sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                assert frames[1] == b"" and frames[3] == b""
                return out
            out.append((frames[1], int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        sock.close(linger=0)


class Index:
    """What a router learns from the events: the hashes each medium holds."""

    def __init__(self):
        self.held = {GPU: set(), CPU: set(), "STORAGE": set()}
        self.stored = {}   # hash -> (parent, tokens) of its first store with tokens

    def apply(self, events):
        for e in events:
            if isinstance(e, (AStored, MStored)):
                for i, h in enumerate(e.block_hashes):
                    assert h not in self.held[e.medium], ("stored twice", e)
                    self.held[e.medium].add(h)
                    parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                    tokens = tuple(e.token_ids[i * BS:(i + 1) * BS])
                    assert self.stored.setdefault(h, (parent, tokens)) == (parent, tokens)
            elif isinstance(e, (ARemoved, MRemoved)):
                for h in e.block_hashes:
                    assert h in self.held[e.medium], ("removed but not held", e)
                    self.held[e.medium].discard(h)
            else:
                self.held[GPU].clear()


def engine_truth(llm):
    """The hashes the engine's device prefix cache, host tier and disk hold."""
    state = llm.engine.scheduler_state
    gpu = {k & MASK for k, _ in state.block_manager.prefix_cache.full_blocks()}
    host = state.host
    cpu = {k & MASK for k in host._lru if host._node.get(k) is None}
    disk = {k & MASK for k in host.disk._keys} if host.disk is not None else set()
    return gpu, cpu, disk


# ------------------------------------------------ engines


def short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvev", dir="/tmp"))   # ipc paths must be short


@pytest.fixture(scope="module")
def tiered(tiny):
    """Array encoding, a 40-block pool, an 8-slot host tier and a disk cache behind it."""
    d = short_dir()
    cfg = dict(enable_kv_cache_events=True, endpoint=f"ipc://{d}/pub",
               replay_endpoint=f"ipc://{d}/replay", topic="kv@pod-0@tiny")
    block_bytes = _block_bytes(tiny[0])
    with LLM(str(tiny[0]), **dict(TINY_ENGINE, num_kv_blocks=40, max_model_len=128),
             kv_offload_bytes=8 * block_bytes, kv_cache_dir=str(d / "disk"),
             kv_events_config=cfg) as llm:
        assert llm.engine.stats()["kv_offload_blocks_total"] == 8
        yield llm, cfg


def _block_bytes(path) -> int:
    with LLM(str(path), **dict(TINY_ENGINE, max_model_len=128),
             kv_offload_bytes=1 << 20) as llm:
        return (1 << 20) // llm.engine.stats()["kv_offload_blocks_total"]


@pytest.fixture(scope="module")
def mapped(tiny):
    """Map encoding, a one-batch queue."""
    d = short_dir()
    cfg = dict(enable_kv_cache_events=True, endpoint=f"ipc://{d}/pub", encoding="map",
               max_queue_size=1)
    with LLM(str(tiny[0]), **TINY_ENGINE, kv_events_config=cfg) as llm:
        yield llm, cfg


# ------------------------------------------------ the engine's events on the wire


def test_stored_blocks_carry_exact_hashes_tokens_and_salt(tiered):
    llm, cfg = tiered
    sub = Subscriber(cfg["endpoint"], "array")
    p = prompt(1, 5 * BS + 3)
    llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
    llm.engine.add_request({"prompt_token_ids": p}, GREEDY, cache_salt="tenant-a")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    messages = sub.take()
    sub.close()
    assert {t for t, _, _ in messages} == {b"kv@pod-0@tiny"}
    batches = [DECODERS["array"].decode(m) for _, _, m in messages]
    assert all(b.data_parallel_rank == 0 and abs(b.ts - time.time()) < 60 for b in batches)
    stored = [e for b in batches for e in b.events if isinstance(e, AStored)]
    for salt in (None, "tenant-a"):
        want = chain(p, salt)
        mine = [e for e in stored if set(e.block_hashes) <= set(want)]
        assert [h for e in mine for h in e.block_hashes] == want
        assert [t for e in mine for t in e.token_ids] == p[:5 * BS]
        assert mine[0].parent_block_hash is None
        for e in mine:
            assert (e.block_size, e.medium, e.lora_id, e.lora_name) == (BS, GPU, None, None)
            check_chained(e, salt)
    assert set(chain(p)).isdisjoint(chain(p, "tenant-a"))


def test_array_events_are_tagged_arrays_of_vllms_positions(tiered):
    llm, cfg = tiered
    sub = Subscriber(cfg["endpoint"], "array")
    llm.generate([{"prompt_token_ids": prompt(2, 2 * BS)}], GREEDY, use_tqdm=False)
    (_, _, payload), = sub.take()
    sub.close()
    ts, events, rank = msgspec.msgpack.decode(payload)
    p = prompt(2, 2 * BS)
    assert rank == 0 and isinstance(ts, float)
    assert events == [["BlockStored", chain(p), None, p, BS, None, "GPU", None]]


def test_evictions_demotions_and_disk_match_the_engine_and_replay(tiered):
    """A router's index built from the events alone equals the device prefix cache, the host
    tier and the disk; a demoted block keeps its parent and tokens; a subscriber that restarts
    gets what it missed through the replay socket, byte for byte."""
    llm, cfg = tiered
    llm.reset_prefix_cache()   # device and host empty; the disk keeps earlier tests' files
    disk_before = engine_truth(llm)[2]
    sub = Subscriber(cfg["endpoint"], "array")
    index = Index()
    for seed in range(10, 20, 2):   # 70 full blocks through a pool of 39
        llm.generate([{"prompt_token_ids": prompt(s, 7 * BS + 3)} for s in (seed, seed + 1)],
                     GREEDY, use_tqdm=False)
    live = sub.take()
    index.apply(sub.events(live))
    gpu, cpu, disk = engine_truth(llm)
    assert index.held[GPU] == gpu and index.held[CPU] == cpu
    assert index.held["STORAGE"] == disk - disk_before
    events = sub.events(live)
    removed = [h for e in events if isinstance(e, ARemoved) and e.medium == GPU
               for h in e.block_hashes]
    demoted = [e for e in events if isinstance(e, AStored) and e.medium == CPU]
    assert removed and sum(len(e.block_hashes) for e in demoted) > 8   # 8 host slots
    assert any(isinstance(e, ARemoved) and e.medium == CPU for e in events)
    for e in demoted:
        check_chained(e)
    # a restart: what the subscriber misses comes back by replay
    last = live[-1][1]
    sub.close()
    llm.generate([{"prompt_token_ids": prompt(30, 4 * BS)}], GREEDY, use_tqdm=False)
    time.sleep(0.3)
    missed = replay(cfg["replay_endpoint"], last + 1)
    assert missed and missed[0][1] == last + 1
    assert [s for _, s, _ in missed] == list(range(last + 1, last + 1 + len(missed)))
    assert replay(cfg["replay_endpoint"], live[0][1])[:len(live)] == live
    index.apply([e for _, _, p in missed for e in DECODERS["array"].decode(p).events])
    assert index.held[GPU] == engine_truth(llm)[0]


def test_reset_publishes_all_blocks_cleared_and_the_host_removals(tiered):
    llm, cfg = tiered
    llm.generate([{"prompt_token_ids": prompt(40, 3 * BS)}], GREEDY, use_tqdm=False)
    time.sleep(0.2)
    sub = Subscriber(cfg["endpoint"], "array")
    held_cpu = engine_truth(llm)[1]
    llm.reset_prefix_cache()
    (_, _, payload), = sub.take()
    sub.close()
    events = DECODERS["array"].decode(payload).events
    assert isinstance(events[0], ACleared)
    assert {h for e in events[1:] for h in e.block_hashes} == held_cpu
    assert all(isinstance(e, ARemoved) and e.medium == CPU for e in events[1:])


def test_map_encoding_and_dropped_batches(mapped):
    llm, cfg = mapped
    sub = Subscriber(cfg["endpoint"], "map")
    p = prompt(50, 3 * BS + 1)
    llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
    messages = sub.take()
    (_, _, payload), = messages
    raw = msgspec.msgpack.decode(payload)[1][0]
    assert raw == {"type": "BlockStored", "block_hashes": chain(p), "parent_block_hash": None,
                   "token_ids": p[:3 * BS], "block_size": BS, "lora_id": None, "medium": "GPU",
                   "lora_name": None, "extra_keys": [None] * 3, "group_idx": 0}
    llm.engine.add_request({"prompt_token_ids": p}, GREEDY, cache_salt="tenant-b")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    messages = sub.take()
    (salted,) = sub.events(messages)   # vLLM's extra keys: the salt on the first block
    assert salted.block_hashes == chain(p, "tenant-b")
    assert salted.extra_keys == [["tenant-b"], None, None]
    check_chained(salted, "tenant-b")
    # the publisher's thread stalls: a one-batch queue takes one batch, drops the rest
    pub = llm.engine.kv_events
    entered, release = threading.Event(), threading.Event()
    encode = pub.wire.encode

    def stalled(*args):
        entered.set()
        release.wait(30)
        return encode(*args)

    pub.wire.encode = stalled
    before = llm.engine.stats()
    try:
        llm.generate([{"prompt_token_ids": prompt(51, 2 * BS + 1)}], GREEDY, use_tqdm=False)
        assert entered.wait(10)
        for seed in range(52, 56):
            llm.generate([{"prompt_token_ids": prompt(seed, 2 * BS + 1)}], GREEDY,
                         use_tqdm=False)
    finally:
        release.set()
    del pub.wire.encode
    after = llm.engine.stats()
    batches = after["kv_events_batches"] - before["kv_events_batches"]
    dropped = after["kv_events_dropped_batches"] - before["kv_events_dropped_batches"]
    assert (batches, dropped) == (2, 3)   # one in the stalled thread, one queued
    got = sub.take()
    sub.close()
    last = messages[-1][1]
    assert [s for _, s, _ in got] == [last + 1, last + 2]   # the next 3 were dropped: a gap
    text = ServerMetrics("tiny", llm.engine.stats).exposition().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["jaxkv:kv_events_dropped_batches"].samples[0].value == \
        after["kv_events_dropped_batches"] == 3


def test_hashes_are_the_same_in_another_process_and_differ_by_salt(tiered):
    p = prompt(60, 4 * BS)
    code = ("import sys; from jaxkv.blocks.prefix_cache import PrefixCache; "
            f"pc = PrefixCache({BS}); p = {p!r}; out = []\n"
            "for salt in (None, 'a', 'b'):\n"
            "    k = pc.root(salt)\n"
            f"    for j in range(4): k = pc.key(k, tuple(p[j * {BS}:(j + 1) * {BS}])); "
            "out.append(k & (2**64 - 1))\n"
            "print(out)")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    theirs = eval(out)
    assert theirs == chain(p) + chain(p, "a") + chain(p, "b")
    assert len(set(theirs)) == 12
    llm, cfg = tiered
    sub = Subscriber(cfg["endpoint"], "array")
    llm.engine.add_request({"prompt_token_ids": p + [7]}, GREEDY, cache_salt="a")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    stored = [h for e in sub.events(sub.take()) if isinstance(e, AStored) and e.medium == GPU
              for h in e.block_hashes]
    sub.close()
    assert stored[:4] == theirs[4:8]


# vLLM 0.32.0's own KVEventBatch (vllm.distributed.kv_events, msgspec 0.23.0) of the events
# test_map_bytes_are_vllms_own rebuilds: its msgpack bytes, byte for byte
VLLM_0_32_BATCH = bytes.fromhex(
    "93cb3ff8000000000000948aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739201cf"
    "ffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c"
    "6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472"
    "615f6b6579739291a173c0a967726f75705f696478008aa474797065ab426c6f636b53746f726564ac626c6f63"
    "6b5f6861736865739107b1706172656e745f626c6f636b5f68617368cf8000000000000000a9746f6b656e5f69"
    "6473920506aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e61"
    "6d65c0aa65787472615f6b65797391c0a967726f75705f6964780184a474797065ac426c6f636b52656d6f7665"
    "64ac626c6f636b5f6861736865739103a66d656469756da3475055a967726f75705f6964780081a474797065b0"
    "416c6c426c6f636b73436c656172656400")


def test_map_bytes_are_vllms_own():
    wire = Wire("map")
    events = [wire.stored([1, MASK], None, [1, 2, 3, 4], 2, "GPU", [("s",), None], 0),
              wire.stored([7], 1 << 63, [5, 6], 2, "CPU", [None], 1),
              wire.removed([3], "GPU", 0), wire.cleared()]
    assert wire.encode(1.5, events, 0) == VLLM_0_32_BATCH


# ------------------------------------------------ the block owners and the tracker


def test_block_manager_records_its_own_transitions():
    bm = BlockManager(4, 2, "hash")
    bm.kv_events = []
    bm.allocate("a", 5, salt="s")
    bm.register("a", [1, 2, 3, 4])
    r0 = bm.prefix_cache.root("s")
    k1 = bm.prefix_cache.key(r0, (1, 2))
    k2 = bm.prefix_cache.key(k1, (3, 4))
    assert bm.take_kv_events() == [Stored(GPU, k1, Origin(k1, 0, None, (1, 2), "s")),
                                   Stored(GPU, k2, Origin(k2, 0, k1, (3, 4), "s"))]
    bm.free("a")
    dropped = bm.copy()
    dropped.allocate("b", 3)   # the free block, then a cached one: a plan the engine drops
    assert dropped.take_kv_events() == [Removed(GPU, k2)] and bm.kv_events == []
    bm.allocate("c", 5)
    assert bm.take_kv_events() == [Removed(GPU, k2), Removed(GPU, k1)]
    bm.reset_prefix_cache()
    assert bm.take_kv_events() == [Cleared()]


def test_hybrid_groups_map_with_group_idx_array_group_0_only():
    bm = BlockManager(8, 2, "hash", windows=(None, 2))
    bm.kv_events = []
    bm.allocate("a", 4)
    bm.register("a", [5, 6, 7, 8])
    records = bm.take_kv_events()
    k1 = bm.prefix_cache.key(bm.prefix_cache.root(None), (5, 6))
    k2 = bm.prefix_cache.key(k1, (7, 8))
    assert [(r.key, r.origin.key, r.origin.group) for r in records] == [
        (k1, k1, 0), (group_key(k1, 1), k1, 1), (k2, k2, 0), (group_key(k2, 1), k2, 1)]
    h1, h2 = k1 & MASK, k2 & MASK   # every group's block under its group-0 hash, as vLLM's
    for encoding, want in (("map", [([h1], 0), ([h1], 1), ([h2], 0), ([h2], 1)]),
                           ("array", [([h1, h2], None)])):   # group 0 only, chained
        wire = Wire(encoding)
        events = KVEventTracker(wire, 2).events(records)
        decoded = DECODERS[encoding].decode(wire.encode(1.0, events, 0)).events
        assert [(e.block_hashes, getattr(e, "group_idx", None)) for e in decoded] == want


def test_tracker_fills_demoted_blocks_and_skips_unpublished_keys():
    o = Origin(11, 0, None, (1, 2), None)
    t = KVEventTracker(Wire("map"), 2)
    first = t.events([Stored(GPU, 11, o), Removed(GPU, 99)])
    second = t.events([Removed(GPU, 11), Stored(CPU, 11), Stored(CPU, 11), Stored(CPU, 12)])
    assert [type(e).__name__ for e in first] == ["BlockStored"]
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in second] == [
        ("BlockRemoved", GPU, [11]), ("BlockStored", CPU, [11]), ("BlockStored", CPU, [12])]
    assert (second[1].token_ids, second[1].parent_block_hash) == ([1, 2], None)
    assert (second[2].token_ids, second[2].block_size) == ([], 0)   # vLLM's placeholder


class EventedMachine(TieredMachine):
    """test_offload's random adds, aborts and steps over a small pool and host tier (hash or
    radix, swap or recompute, one group or a hybrid cache's), events on: after every step, a
    router's index built from the map-encoded events alone holds exactly the (hash, group) of
    every full block the device prefix cache and the host tier hold."""

    @initialize(mode=st.sampled_from(["swap", "recompute", "auto"]),
                prefix=st.sampled_from(["hash", "radix"]), host=st.integers(1, 6),
                windows=st.sampled_from([(None,), (None,), (None, 6), (None, 5, 9)]))
    def setup(self, mode, prefix, host, windows):
        super().setup(mode, prefix, host, windows)
        self.state = with_cost_model(init_state(self.cc, kv_events=True),
                                     SwapCostModel(1, 1e9, 1e9, 1.0))
        self.wire = Wire("map")
        self.tracker = KVEventTracker(self.wire, self.cc.block_size)
        self.held = {GPU: set(), CPU: set()}
        self.ident = {}   # a block owner's key -> (hash, group), from the records' origins

    def step(self):
        super().step()
        state = self.state
        records = state.block_manager.take_kv_events() + state.host.take_kv_events()
        self.ident.update({r.key: (r.origin.key & MASK, r.origin.group) for r in records
                           if isinstance(r, Stored) and r.origin is not None})
        payload = self.wire.encode(0.0, self.tracker.events(records), 0)
        for e in DECODERS["map"].decode(payload).events:
            for h in e.block_hashes:
                held = self.held[e.medium]
                assert ((h, e.group_idx) in held) == isinstance(e, MRemoved), e
                (held.discard if isinstance(e, MRemoved) else held.add)((h, e.group_idx))
        bs, host = self.cc.block_size, state.host
        gpu = {self.ident[k] for k, _ in state.block_manager.prefix_cache.full_blocks()}
        cpu = {self.ident[k] for k in host._lru if len(host._node.get(k, (0, [0] * bs))[1]) == bs}
        assert (self.held[GPU], self.held[CPU]) == (gpu, cpu)


EventedMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40,
                                            deadline=None)
test_events_follow_the_block_owners = EventedMachine.TestCase


def test_a_bound_endpoint_is_refused_naming_the_field():
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.bind("tcp://*:0")
    port = sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
    try:
        cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
        with pytest.raises(ValueError, match=f"kv_events_config.endpoint='tcp://\\*:{port}'"):
            ZmqEventPublisher(cfg, Wire("array"))
    finally:
        sock.close(linger=0)


# ------------------------------------------------ the config


@pytest.mark.parametrize("value,message", [
    ({"endpont": "tcp://*:1"}, "kv_events_config has no field 'endpont'; did you mean endpoint"),
    ({"publisher": "kafka"}, r"kv_events_config.publisher='kafka' is not one of: zmq, null"),
    ({"endpoint": "http://x"}, r"kv_events_config.endpoint='http://x' is not a ZMQ endpoint"),
    ({"buffer_steps": 0}, r"kv_events_config.buffer_steps=0 must be >= 1"),
    ({"max_queue_size": "9"}, r"kv_events_config.max_queue_size='9' is not an int"),
    ({"encoding": "json"}, r"kv_events_config.encoding='json' is not one of: array, map"),
    ({"enable_kv_cache_events": 1}, r"kv_events_config.enable_kv_cache_events=1 is not a bool"),
    ("on", r"kv_events_config='on' is not a dict"),
])
def test_bad_config_raises_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(kv_events_config=value)


def test_config_defaults_cli_flag_and_ranks():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    ns = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, '
                            '"endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6100"}'])
    cfg = EngineConfig.from_cli(ns).kv_events.kv_events_config
    assert (cfg.publisher, cfg.encoding, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size,
            cfg.topic) == ("zmq", "array", 10_000, 100_000, 100_000, "")
    r2 = cfg.for_rank(2)
    assert (r2.endpoint, r2.replay_endpoint, r2.data_parallel_rank) == (
        "tcp://*:6002", "tcp://*:6102", 2)
    assert KVEventsConfig(endpoint="inproc://ev").for_rank(1).endpoint == "inproc://ev_dp1"
    assert not EngineConfig.from_kwargs(kv_events_config={}).kv_events.enabled
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-config", "{oops"])
    from jaxkv.entrypoints.cli import build_parser   # jaxkv serve's flags are EngineConfig's
    ns = build_parser().parse_args(["serve", "--kv-events-config", '{"topic": "kv@p@m"}'])
    assert EngineConfig.from_cli(ns).kv_events.kv_events_config.topic == "kv@p@m"
    with pytest.raises(ValueError, match="needs prefix_caching"):
        EngineConfig.from_kwargs(kv_events_config={"enable_kv_cache_events": True},
                                 prefix_caching=None)


# ------------------------------------------------ llm-d's gauges


def test_llm_d_gauges_equal_the_engines_numbers(mapped):
    llm, _ = mapped
    engine = llm.engine
    for seed in range(70, 82):
        engine.add_request({"prompt_token_ids": prompt(seed, 30)},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    seen = set()
    while engine.has_unfinished_requests():
        text = ServerMetrics("tiny", engine.stats).exposition().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        state = engine.scheduler_state
        running, waiting = len(state.running), len(state.waiting)   # one sample a request
        usage = 1 - len(state.block_manager.free_block_ids()) / (TINY_ENGINE["num_kv_blocks"] - 1)
        got = {n: fams[n].samples[0].value for n in
               ("vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc")}
        assert got == {"vllm:num_requests_running": running,
                       "vllm:num_requests_waiting": waiting,
                       "vllm:kv_cache_usage_perc": pytest.approx(usage)}
        (info,) = fams["vllm:cache_config_info"].samples
        assert info.value == 1 and info.labels == {
            "model_name": "tiny", "block_size": str(BS),
            "num_gpu_blocks": str(TINY_ENGINE["num_kv_blocks"])}
        seen.add((running, waiting))
        engine.step()
    assert any(r and w for r, w in seen)   # some step had both running and waiting requests


def test_the_servers_metrics_route_serves_them(tiny):
    import asyncio

    import httpx

    from jaxkv import AsyncLLM
    from jaxkv.server.app import build_app

    engine = AsyncLLM(str(tiny[0]), **TINY_ENGINE)

    async def scrape():
        transport = httpx.ASGITransport(app=build_app(engine, served_model_name="tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as h:
            return (await h.get("/metrics")).text

    try:
        fams = {f.name: f for f in text_string_to_metric_families(asyncio.run(scrape()))}
    finally:
        engine.shutdown()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        assert [(s.labels, s.value) for s in fams[name].samples] == [({"model_name": "tiny"}, 0)]
    assert [(s.labels, s.value) for s in fams["vllm:cache_config_info"].samples] == [
        ({"model_name": "tiny", "block_size": str(BS),
          "num_gpu_blocks": str(TINY_ENGINE["num_kv_blocks"])}, 1)]
