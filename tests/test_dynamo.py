"""jaxkv as an NVIDIA Dynamo backend (jaxkv/entrypoints/dynamo/): the ``LLMEngine`` class driven
directly (no Dynamo runtime: start's registration, generate against the offline engine's greedy
tokens, cancellation, the KV events Dynamo's worker subscribes to, load snapshots, cleanup),
then end to end (slow): Dynamo's own frontend with KV routing and file discovery in front of two
jaxkv workers on SmolLM2, driven by the ``openai`` client: completions and chat, streamed and
not, cancellation, KV-aware placement of a repeated prompt, a worker killed mid-run.

Skipped without Dynamo (``pip install 'jaxkv[dynamo]'``; see docs/dynamo.md for a venv).
By hand: ``python bench/dynamo_up.py --workers 2`` brings the same deployment up.
"""

import asyncio
import signal
import threading
import time

import msgspec
import pytest

pytest.importorskip("dynamo.common.backend", reason="NVIDIA Dynamo (ai-dynamo 1.6) is not "
                    "installed: pip install 'jaxkv[dynamo]'")
pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installed")

from jaxkv import SamplingParams  # noqa: E402
from jaxkv.config import EngineConfig  # noqa: E402
from jaxkv.entrypoints.dynamo.engine import JaxkvEngine  # noqa: E402
from tiny_models import TINY_ENGINE  # noqa: E402

zmq = pytest.importorskip("zmq")


class Context:
    """Dynamo's request ``Context``, as much of it as the engine reads."""

    def __init__(self, rid: str):
        self.rid, self.stopped = rid, False

    def id(self):
        return self.rid

    def is_stopped(self):
        return self.stopped


class Publisher:
    """Dynamo's ``SnapshotPublisher``: records what is pushed."""

    def __init__(self):
        self.snapshots = []

    def publish(self, rank, snap):
        self.snapshots.append((rank, snap))


def greedy(tokens, max_tokens):
    return {"token_ids": list(tokens), "sampling_options": {"temperature": 0.0},
            "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True,
                                "stop_token_ids_hidden": [2]}}


@pytest.fixture(scope="module")
def backend(tiny):
    engine = JaxkvEngine(EngineConfig.from_kwargs(model=str(tiny[0]), **TINY_ENGINE), "tiny")
    registration = asyncio.run(engine.start(worker_id=7))
    yield engine, registration
    asyncio.run(engine.cleanup())


async def collect(engine, request, context, cancel_after=None):
    chunks = []
    async for chunk in engine.generate(request, context):
        chunks.append(chunk)
        if cancel_after is not None and len(chunks) == cancel_after:
            context.stopped = True
            await engine.abort(context)
    return chunks


def test_start_registers_the_engines_geometry(backend, tiny):
    engine, reg = backend
    core = engine.llm.engine
    assert reg.served_model_name == "tiny" and reg.model == str(tiny[0])   # an HF dir: as is
    assert reg.llm.kv_cache_block_size == TINY_ENGINE["block_size"]
    assert reg.llm.total_kv_blocks == core.cache_config.num_usable_blocks
    assert reg.llm.context_length == TINY_ENGINE["max_model_len"]
    assert reg.llm.max_num_seqs == TINY_ENGINE["max_num_seqs"]
    assert reg.llm.max_num_batched_tokens == TINY_ENGINE["max_num_batched_tokens"]


def test_generate_streams_the_offline_engines_greedy_tokens(backend, tiny_llm):
    engine, _ = backend
    tokens = tiny_llm.tokenizer.encode("It is a truth universally acknowledged")
    want = tiny_llm.generate([{"prompt_token_ids": tokens}], SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    chunks = asyncio.run(collect(engine, greedy(tokens, 10), Context("r1")))
    assert [t for c in chunks for t in c["token_ids"]] == want
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["completion_usage"]["completion_tokens"] == 10


def test_a_bad_request_is_an_invalid_argument(backend):
    from dynamo.llm.exceptions import InvalidArgument

    engine, _ = backend
    bad = {**greedy([5, 6, 7], 4), "sampling_options": {"n": 3}}
    with pytest.raises(InvalidArgument, match="n=3"):
        asyncio.run(collect(engine, bad, Context("bad")))
    too_long = greedy(list(range(3, 300)), 4)   # longer than max_model_len
    with pytest.raises(InvalidArgument):
        asyncio.run(collect(engine, too_long, Context("long")))


def test_a_cancelled_context_ends_the_stream_and_frees_the_request(backend, tiny_llm):
    engine, _ = backend
    tokens = tiny_llm.tokenizer.encode("Emma Woodhouse, handsome, clever, and rich")
    chunks = asyncio.run(collect(engine, greedy(tokens, 200), Context("c1"), cancel_after=2))
    assert chunks[-1]["finish_reason"] == "cancelled" and len(chunks) <= 4
    deadline = time.monotonic() + 10
    while engine.llm.stats_now()["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    s = engine.llm.stats_now()
    assert s["num_requests_running"] == s["num_requests_waiting"] == 0


def test_the_kv_event_source_carries_block_stored_events(backend, tiny_llm):
    """The socket Dynamo's worker subscribes to (``ZmqSource``) gets vLLM-format batches of
    the request's full blocks, with their exact tokens."""
    engine, _ = backend
    (source,) = asyncio.run(engine.kv_event_sources())
    assert source.endpoint.startswith("ipc://") and source.dp_rank == 0
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
    sub.connect(source.endpoint)
    time.sleep(0.5)   # the subscription reaches the publisher
    bs = TINY_ENGINE["block_size"]
    tokens = tiny_llm.tokenizer.encode("Mr. Knightley, a sensible man about seven or eight "
                                       "and thirty, was not only a very old friend")[:3 * bs]
    asyncio.run(collect(engine, greedy(tokens, 2), Context("ev")))
    stored = []
    while sub.poll(2000):
        _, _, payload = sub.recv_multipart()
        batch = msgspec.msgpack.decode(payload)
        stored += [e for e in batch[1] if e[0] == "BlockStored"]
    sub.close()
    blocks = [t for e in stored for t in e[3]]   # token_ids of every stored block, in order
    assert blocks[:3 * bs] == tokens and all(e[4] == bs for e in stored)


def test_load_snapshots_follow_the_engine(backend):
    engine, _ = backend
    publisher = Publisher()
    engine.attach_snapshot_publisher(publisher)
    try:
        asyncio.run(collect(engine, greedy([5, 6, 7, 8, 9], 3), Context("s1")))
        time.sleep(0.3)
    finally:
        engine._snapshots.stop()
        engine._snapshots = None
    rank, snap = publisher.snapshots[-1]
    stats = engine.llm.stats_now()
    assert rank == 0 and snap.dp_rank == 0
    assert snap.kv_total_blocks == stats["kv_blocks_total"]
    assert snap.kv_used_blocks == stats["kv_blocks_used"]
    assert snap.kv_cache_hit_rate == pytest.approx(stats["prefix_cache_hit_rate"])


def test_cleanup_is_idempotent(tiny):
    engine = JaxkvEngine(EngineConfig.from_kwargs(model=str(tiny[0]), **TINY_ENGINE), "t")
    asyncio.run(engine.cleanup())   # after a start that never happened: null-safe
    asyncio.run(engine.cleanup())


# ------------------------------------------------------------ end to end (Dynamo's frontend)

@pytest.fixture(scope="module")
def cluster():
    from bench.lib.dynamo_cluster import DynamoCluster

    c = DynamoCluster(workers=2, router_mode="kv", frontend_args=["--migration-limit", "3"])
    try:
        c.start(timeout=600)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def client(cluster):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=cluster.base_url, api_key="-", max_retries=0,
                       timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """SmolLM2's greedy answers from the offline engine (the workers' engine flags)."""
    from jaxkv import LLM

    with LLM("SmolLM2-135M-Instruct", max_model_len=1024, max_num_seqs=8) as llm:
        t = llm.tokenizer
        chat = t.encode(t.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]),
                        add_special_tokens=False)
        outs = llm.generate(["The capital of France is", {"prompt_token_ids": chat}],
                            SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        yield {"completion": outs[0].outputs[0].text, "chat": outs[1].outputs[0].text}


MODEL = "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_e2e_completions_streamed_and_not(client, reference):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=16, temperature=0)
    assert whole.choices[0].text == reference["completion"]
    assert whole.usage.prompt_tokens == 5
    chunks = list(client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["completion"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.slow
def test_e2e_chat_streamed_and_not(client, reference):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           temperature=0)
    assert whole.choices[0].message.content == reference["chat"].strip()
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


@pytest.mark.slow
def test_e2e_a_cancelled_stream_frees_the_worker(client, cluster):
    before = [cluster.worker_metrics(i) for i in range(2)]
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = [cluster.worker_metrics(i) for i in range(2)]
        aborted = sum(a['vllm:request_success_total{finished_reason="abort"}'] -
                      b['vllm:request_success_total{finished_reason="abort"}']
                      for a, b in zip(after, before))
        if aborted == 1 and all(a["vllm:num_requests_running"] == 0 for a in after):
            break
        time.sleep(0.5)
    assert aborted == 1
    assert all(a["vllm:num_requests_running"] == 0 for a in after)
    generated = sum(a["vllm:generation_tokens_total"] - b["vllm:generation_tokens_total"]
                    for a, b in zip(after, before))
    assert generated < 400   # stopped well before max_tokens


@pytest.mark.slow
def test_e2e_kv_routing_sends_a_repeated_prefix_to_the_worker_that_holds_it(client, cluster):
    """The router learns where the prompt's blocks are from the workers' KV events: every
    repeat of a long shared prefix lands on the worker that cached it, and reuses it."""
    system = "You are a careful assistant. " + " ".join(
        f"Rule {i}: answer in plain words and keep to the facts of question {i}."
        for i in range(20))
    before = [cluster.worker_metrics(i)["vllm:prefix_cache_hits_total"] for i in range(2)]
    cached = []
    for q in ("What is 2+2?", "Name a colour.", "What is the capital of Italy?",
              "Count to three."):
        r = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        time.sleep(0.3)   # the events reach the router
    hits = [cluster.worker_metrics(i)["vllm:prefix_cache_hits_total"] - before[i]
            for i in range(2)]
    assert all(c >= 256 for c in cached[1:]), cached   # the ~300-token prefix, whole blocks
    assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 3 * 256, hits   # all on one worker


@pytest.mark.slow
def test_e2e_a_worker_killed_mid_run(client, cluster):
    """SIGKILL one worker while requests stream through both: each request completes (the
    frontend migrates it) or fails with an API error, none hangs; the frontend then serves
    every new request on the survivor."""
    import openai

    results = []

    def one(i):
        try:
            r = client.completions.create(model=MODEL, prompt=f"Story {i}: once upon a time",
                                          max_tokens=60, temperature=0,
                                          extra_body={"ignore_eos": True})
            results.append(("ok", r.usage.completion_tokens))
        except openai.APIError as e:
            results.append(("error", type(e).__name__))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(3)
    on_victim = cluster.worker_metrics(0)["vllm:num_requests_running"]
    cluster.kill_worker(0, signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and len(results) == 6
    assert all(r == ("ok", 60) or r[0] == "error" for r in results), results
    if on_victim:   # what the killed worker was running was retried on the other
        log = (cluster.root / "frontend.log").read_text(errors="replace")
        assert "migration retry scheduled" in log
    survivors = []
    deadline = time.monotonic() + 120
    while len(survivors) < 5 and time.monotonic() < deadline:
        try:
            r = client.completions.create(model=MODEL, prompt="After the crash,", max_tokens=4,
                                          temperature=0)
            survivors.append(r.choices[0].text)
        except openai.APIError:
            survivors.clear()   # the frontend has not dropped the dead worker yet
            time.sleep(1)
    assert len(survivors) == 5 and len(set(survivors)) == 1
    print(f"killed mid-run with {on_victim:.0f} requests on it:", results)
