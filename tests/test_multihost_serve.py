"""Multi-host serving (issue 55): the leader's engine inputs replayed on followers.

* In one process (default suite): an ``AsyncLLM`` leader with a ``StepFeed`` and a follower
  ``EngineCore`` replaying it over loopback ZMQ end every request with the same tokens, aborts
  and late adds included; a follower that goes silent or reports a failure fails the leader's
  requests with ``EngineDeadError`` within the peer timeout, the leader's device thread held
  inside a step; a Dynamo worker (where Dynamo is installed) leads a follower the same way.
* Two processes x 2 fake CPU devices (slow): ``jaxkv serve`` at TP 4 on process 0 and its
  follower on process 1, driven by the official ``openai`` client, give the tokens of one
  process at TP 4 (tests/tp_worker.py ``requests``); a killed follower makes the leader answer
  the next request with an error and exit, within a bound.
"""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jaxkv import AsyncLLM, SamplingParams
from jaxkv.config import EngineConfig
from jaxkv.engine.async_llm import EngineDeadError
from jaxkv.engine.core import EngineCore
from jaxkv.engine.multihost import FollowerLink, StepFeed, check_multihost, replay
from tiny_models import TINY_ENGINE

PROMPTS = ["Emma Woodhouse, handsome, clever,", "and rich, with a comfortable home",
           "seemed to unite some of the best blessings of existence;", "She was the youngest"]


class RecordingEngine:
    """An ``EngineCore`` whose step outputs are kept: each request's last (tokens, finish
    reason) per completion."""

    def __init__(self, engine: EngineCore):
        self.engine, self.last = engine, {}

    def add_request(self, **kw):
        return self.engine.add_request(**kw)

    def abort_request(self, request_id):
        self.engine.abort_request(request_id)

    def step(self):
        outputs = self.engine.step()
        self.last |= {rid: _completions(out) for rid, out in outputs.items()}
        return outputs


def _completions(out) -> list[tuple[list[int], str | None]]:
    return [(list(c.token_ids), c.finish_reason) for c in out.outputs]


def _follow(address, engine, done: dict) -> None:
    link = FollowerLink(address, 1, timeout=30)
    try:
        replay(engine, link)
        done["stopped"] = True
    except BaseException as e:   # noqa: BLE001 - reported to the test's thread
        done["error"] = e
    finally:
        link.close()


async def _drive(leader: AsyncLLM) -> dict:
    """Concurrent greedy, seeded and n=2 requests, one aborted after 3 outputs, one added
    while the others run; the last output of each by request id (``_completions``)."""
    async def run(rid, prompt, params, stop_after=None):
        tokens, seen = None, 0
        async for out in leader.generate(prompt, params, request_id=rid):
            tokens, seen = _completions(out), seen + 1
            if seen == stop_after:
                break
        return rid, tokens

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.8, n=2, max_tokens=10, ignore_eos=True)
    first = [asyncio.create_task(run("greedy", PROMPTS[0], greedy)),
             asyncio.create_task(run("seeded", PROMPTS[1], seeded)),
             asyncio.create_task(run("unseeded", PROMPTS[2], unseeded)),
             asyncio.create_task(run("aborted", PROMPTS[3], greedy, stop_after=3))]
    await asyncio.sleep(0.05)
    late = asyncio.create_task(run("late", {"prompt_token_ids": [5, 6, 7, 8, 9]}, greedy))
    return dict(await asyncio.gather(*first, late))


def test_a_follower_replaying_the_feed_ends_every_request_with_the_leaders_tokens(tiny):
    config = EngineConfig.from_kwargs(model=str(tiny[0]), **TINY_ENGINE)
    feed = StepFeed("127.0.0.1", 1, timeout=30)
    follower, done = RecordingEngine(EngineCore(config)), {}
    thread = threading.Thread(target=_follow, args=(feed.address, follower, done))
    thread.start()
    lost = []
    feed.wait_for_followers(lost.append, within=30)
    leader = AsyncLLM(str(tiny[0]), step_feed=feed, **TINY_ENGINE)
    try:
        leader_tokens = asyncio.run(_drive(leader))
    finally:
        leader.shutdown()          # stops the follower too
        thread.join(30)
    follower.engine.close()
    assert not thread.is_alive() and done == {"stopped": True} and lost == []
    assert leader.engine.runner.num_steps == follower.engine.runner.num_steps   # in lockstep
    assert leader_tokens["greedy"] == [(follower.last["greedy"][0][0], "length")]
    assert len(leader_tokens["greedy"][0][0]) == 12
    assert leader_tokens["unseeded"][0][0] != leader_tokens["unseeded"][1][0]
    (seen, _), = leader_tokens.pop("aborted")   # the client stopped reading: the engine may
    (tokens, reason), = follower.last.pop("aborted")      # have gone a step further
    assert tokens[:len(seen)] == seen and len(tokens) < 12 and reason == "abort"
    assert follower.last == leader_tokens


class DynamoContext:
    """Dynamo's request ``Context``, as much of it as ``JaxkvEngine.generate`` reads."""

    def __init__(self, rid: str):
        self.rid = rid

    def id(self):
        return self.rid

    def is_stopped(self):
        return False


def test_a_dynamo_worker_leads_a_follower_and_its_cleanup_stops_it(tiny):
    pytest.importorskip("dynamo.common.backend", reason="NVIDIA Dynamo is not installed")
    from jaxkv.entrypoints.dynamo.engine import JaxkvEngine

    config = EngineConfig.from_kwargs(model=str(tiny[0]), **TINY_ENGINE)
    feed = StepFeed("127.0.0.1", 1, timeout=30)
    follower, done = RecordingEngine(EngineCore(config)), {}
    thread = threading.Thread(target=_follow, args=(feed.address, follower, done))
    thread.start()
    worker = JaxkvEngine(config, "tiny", feed)
    request = {"token_ids": [5, 6, 7, 8, 9], "sampling_options": {"temperature": 0.0},
               "stop_conditions": {"max_tokens": 8, "ignore_eos": True}}

    async def run():
        await worker.start(worker_id=1)
        return [t async for chunk in worker.generate(request, DynamoContext("d1"))
                for t in chunk["token_ids"]]

    try:
        tokens = asyncio.run(run())
    finally:
        asyncio.run(worker.cleanup())
        thread.join(30)
    follower.engine.close()
    assert not thread.is_alive() and done == {"stopped": True}
    assert len(tokens) == 8 and follower.last == {"d1": [(tokens, "length")]}


@pytest.mark.parametrize("how", ["silent", "failed"])
def test_a_lost_follower_fails_the_leaders_requests_within_the_timeout(tiny, how):
    """The leader's device thread is held inside a step, as a collective with a dead peer
    holds it: the requests still fail, without the engine lock, within the timeout."""
    feed = StepFeed("127.0.0.1", 1, timeout=1.0)
    link = FollowerLink(feed.address, 1, timeout=1.0)
    reasons, stuck, release = [], threading.Event(), threading.Event()
    leader = AsyncLLM(str(tiny[0]), step_feed=feed, **TINY_ENGINE)
    step = leader.engine.step

    def hung_step():
        stuck.set()
        release.wait()
        return step()

    def lost(reason):
        reasons.append(reason)
        leader.fail(EngineDeadError(f"lost: {reason}"))

    feed.wait_for_followers(lost, within=10)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def scenario():
        async for _ in leader.generate(PROMPTS[0], params):   # compiled, nothing lost
            pass
        leader.engine.step = hung_step
        stream = await leader.add_request(PROMPTS[1], params)
        await asyncio.to_thread(stuck.wait, 10)
        started = time.monotonic()
        if how == "silent":
            link.close()
        else:
            link.report(RuntimeError("boom"))
        with pytest.raises(EngineDeadError, match="lost: follower"):
            async for _ in stream:
                pass
        elapsed = time.monotonic() - started
        try:
            with pytest.raises(EngineDeadError):    # the lock is held: refused before it
                await asyncio.wait_for(leader.add_request(PROMPTS[2], params), 5)
        finally:
            release.set()
        return elapsed

    try:
        elapsed = asyncio.run(scenario())
    finally:
        release.set()
        leader.shutdown()
        if how == "failed":
            link.close()
    assert reasons and elapsed < 1.0 + 2.0   # the timeout, and a margin for a loaded machine
    expected = "failed: RuntimeError('boom')" if how == "failed" else "no heartbeat for 1.0 s"
    assert len(reasons) == 1 and expected in reasons[0]


def test_multihost_refuses_time_driven_decisions_and_a_bad_timeout(tiny):
    def config(**kw):
        return EngineConfig.from_kwargs(model=str(tiny[0]), **TINY_ENGINE, **kw)

    with pytest.raises(ValueError, match="peer_timeout=0"):
        check_multihost(config(), 0)
    with pytest.raises(ValueError, match="preemption_mode='recompute'"):
        check_multihost(config(kv_offload_bytes=1 << 20), 10)
    with pytest.raises(ValueError, match="speculative_adaptive=False"):
        check_multihost(config(speculative="ngram"), 10)
    check_multihost(config(kv_offload_bytes=1 << 20, preemption_mode="swap"), 10)
    check_multihost(config(speculative="ngram", speculative_adaptive=False), 10)


# ---------------------------------------------------------------------- two processes

SERVE_ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                    num_kv_blocks=48, block_size=8, token_buckets=(32,), seq_buckets=(4,),
                    dtype="float32")
PEER_TIMEOUT = 5.0
MAX_TOKENS = 12
# (prompt, request options): greedy, seeded sampling, greedy streamed
SERVED = [(PROMPTS[0], dict(temperature=0)), (PROMPTS[1], dict(temperature=1.0, seed=11)),
          (PROMPTS[2], dict(temperature=0))]


@pytest.fixture(scope="module")
def tp_llama(tmp_path_factory):
    pytest.importorskip("torch")
    from tp_runner import write_tiny

    return write_tiny(tmp_path_factory.mktemp("llama"), "llama")


def _engine_flags() -> list[str]:
    flags = []
    for key, value in SERVE_ENGINE.items():
        flags += ["--" + key.replace("_", "-"), *map(str, value if isinstance(value, tuple)
                                                     else [value])]
    return flags


def _serve(model, process_id: int, coordinator: int, port: int, log) -> subprocess.Popen:
    from tp_runner import REPO, worker_env

    cmd = [sys.executable, "-m", "jaxkv", "serve", "--model", str(model), "--port", str(port),
           "--served-model-name", "tiny", "--log-level", "warning", "--tensor-parallel-size",
           "4", *_engine_flags(), "--coordinator-address", f"127.0.0.1:{coordinator}",
           "--num-processes", "2", "--process-id", str(process_id),
           "--peer-timeout", str(PEER_TIMEOUT)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**worker_env(2), "PYTHONUNBUFFERED": "1"})


def _wait_healthy(url: str, procs, logs, within: float = 400) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs):
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the leader was not healthy in time:\n{logs[0].read_text()[-4000:]}")


def _texts(client, prompt, options, stream=False) -> list[str]:
    """The completion's tokens as the server's logprobs name them."""
    kw = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, logprobs=1,
              extra_body={"ignore_eos": True}, **options)
    if not stream:
        return client.completions.create(**kw).choices[0].logprobs.tokens
    return [t for chunk in client.completions.create(stream=True, **kw)
            for t in (chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else [])]


def _cancelled(client) -> int:
    """A stream closed after its second chunk; how many chunks were read."""
    stream = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=100,
                                       stream=True, extra_body={"ignore_eos": True})
    read = 0
    for _ in stream:
        read += 1
        if read == 2:
            break
    stream.close()
    return read


@pytest.mark.slow
def test_two_process_serve_gives_one_process_tokens_then_fails_without_its_follower(
        tp_llama, tmp_path):
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from tp_runner import free_port, run_worker

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"engine": SERVE_ENGINE, "requests": [
        {"prompt": p, "params": dict(max_tokens=MAX_TOKENS, ignore_eos=True, **o)}
        for p, o in SERVED]}))
    ref = run_worker("requests", tp_llama, spec, "--tp", 4, devices=4)["token_texts"]
    port, coordinator = free_port(), free_port()
    logs = [tmp_path / "leader.log", tmp_path / "follower.log"]
    files = [open(log, "wb") for log in logs]
    procs = [_serve(tp_llama, i, coordinator, port, f) for i, f in enumerate(files)]
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, procs, logs)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        with ThreadPoolExecutor(4) as pool:
            jobs = [pool.submit(_texts, client, p, o, stream=i == 2)
                    for i, (p, o) in enumerate(SERVED)] + [pool.submit(_cancelled, client)]
            got = [job.result() for job in jobs]
        assert got[:3] == [r[0] for r in ref] and got[3] == 2
        assert _texts(client, *SERVED[1]) == ref[1][0]    # the abort was replayed in step
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(30)
        started = time.monotonic()
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
            _texts(client.with_options(timeout=60), *SERVED[0])
        assert procs[0].wait(PEER_TIMEOUT + 30) == 1, logs[0].read_text()[-4000:]
        assert time.monotonic() - started < PEER_TIMEOUT + 30
        assert "lost a process: follower(s) 1 sent no heartbeat" in logs[0].read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in files:
            f.close()
