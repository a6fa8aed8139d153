"""The engine core and its facades on a tiny HF checkpoint: outputs routed to their own
requests (interleaved streams, threads, generate beside streams, AsyncLLM coroutines), request
isolation (poison inputs refused before queueing, a request failing mid-step ends alone with
``finish_reason="error"``, an interrupted generate leaves nothing running) and the grouped
engine config."""

import asyncio
import threading

import pytest

from jaxkv import LLM, AsyncLLM, DataParallelLLM, EngineConfig, SamplingParams
from jaxkv.engine.detokenize import IncrementalDetokenizer
from tiny_models import TINY_ENGINE, austen_prompts

ENGINE = TINY_ENGINE
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm


def prompts(n, seed=0):
    return austen_prompts(n, seed, max_chars=150)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm):
    s = llm.stats()
    assert (s["num_running"], s["num_waiting"], s["kv_blocks_used"]) == (0, 0, 0)
    llm.engine.check_invariants()


def test_interleaved_streams_in_one_thread_equal_generate(llm):
    ps = prompts(5, seed=1)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    streams = [llm.stream(p, GREEDY) for p in ps]
    last = [None] * len(ps)
    live = set(range(len(ps)))
    while live:   # round-robin: each stream pulls one output in turn
        for i in sorted(live):
            try:
                out = next(streams[i])
            except StopIteration:
                live.discard(i)
                continue
            assert out.request_id == streams[i].request_id
            last[i] = out
    assert tokens(last) == want and all(o.finished for o in last)
    assert_idle(llm)


def test_a_stream_open_while_generate_runs(llm):
    ps = prompts(4, seed=2)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    stream = llm.stream(ps[0], GREEDY)
    first = next(stream)                       # the stream is live while generate runs
    outs = llm.generate(ps[1:], GREEDY, use_tqdm=False)
    rest = list(stream)
    assert tokens(outs) == want[1:]
    assert (rest or [first])[-1].outputs[0].token_ids == want[0]
    assert_idle(llm)


def test_streams_in_threads_equal_generate(llm):
    ps = prompts(4, seed=3)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    got, errors = [None] * len(ps), []

    def consume(i):
        try:
            got[i] = [o for o in llm.stream(ps[i], GREEDY)][-1].outputs[0].token_ids
        except BaseException as e:   # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and got == want
    assert_idle(llm)


def test_closing_a_stream_aborts_only_its_request(llm):
    ps = prompts(2, seed=4)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    a, b = llm.stream(ps[0], long), llm.stream(ps[1], GREEDY)
    next(a), next(b)
    a.close()
    assert not llm.engine.is_live(a.request_id)
    assert list(a) == []
    rest = list(b)
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == GREEDY.max_tokens
    assert_idle(llm)


@pytest.mark.parametrize("make_call, error, field", [
    (lambda llm: llm.generate({"prompt_token_ids": "123"}, GREEDY), TypeError,
     "prompt_token_ids"),
    (lambda llm: llm.generate({"prompt_token_ids": [1.0, 2.0]}, GREEDY), TypeError,
     r"prompt_token_ids\[0\]"),
    (lambda llm: llm.generate("hi", SamplingParams(stop_token_ids=[10**9])), ValueError,
     "stop_token_ids"),
    (lambda llm: llm.generate("hi", GREEDY, cache_salt=["x"]), TypeError, "cache_salt"),
    (lambda llm: llm.stream("hi", GREEDY, cache_salt=["x"]), TypeError, "cache_salt"),
    (lambda llm: llm.add_request("hi", GREEDY, priority=1.5), TypeError, "priority"),
    (lambda llm: llm.generate(["ok", {"prompt_token_ids": [5, -1]}], GREEDY), ValueError,
     r"requests\[1\].*prompt_token_ids"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=300)), ValueError,
     "max_model_len"),
])
def test_poison_requests_are_refused_before_queueing(llm, make_call, error, field):
    before = llm.stats()["num_prompt_tokens"]
    with pytest.raises(error, match=field):
        make_call(llm)
    assert_idle(llm)
    assert llm.stats()["num_prompt_tokens"] == before
    assert len(llm.generate("It was", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_p=float("inf")), ValueError, "top_p"),
    (dict(max_tokens=1.5), TypeError, "max_tokens"),
    (dict(max_tokens=True), TypeError, "max_tokens"),
])
def test_poison_sampling_params_are_refused(kwargs, error, field):
    with pytest.raises(error, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(max_model_len=0), ValueError, "max_model_len"),
    (dict(seed="x"), TypeError, "seed"),
    (dict(max_num_seqs=2.0), TypeError, "max_num_seqs"),
    (dict(gpu_memory_utilization=float("nan")), ValueError, "gpu_memory_utilization"),
    (dict(max_num_seq=4), TypeError, "max_num_seqs"),       # a typo names the close match
    (dict(num_kv_blocks=40, num_gpu_blocks_override=40), TypeError, "twice"),
    (dict(prefix_caching="lru"), ValueError, "prefix_caching"),
])
def test_bad_engine_arguments_name_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        EngineConfig.from_kwargs(**kwargs)


def test_engine_arguments_are_one_config_for_kwargs_and_cli():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    ns = parser.parse_args(["--max-num-seqs", "4", "--num-kv-blocks", "50", "--kv-cache-memory",
                            "1GiB", "--prefix-caching", "none", "--no-compilation-cache"])
    config = EngineConfig.from_cli(ns)
    assert config == EngineConfig.from_kwargs(max_num_seqs=4, num_kv_blocks=50,
                                              kv_cache_bytes=2**30, prefix_caching=None,
                                              compilation_cache=False)
    assert EngineConfig.from_kwargs(**config.to_kwargs()) == config
    assert "max_num_batched_tokens" in LLM.__doc__ and "gpu_memory_utilization" in LLM.__doc__


def test_data_parallel_is_explicit(tiny):
    with pytest.raises(ValueError, match="DataParallelLLM"):
        LLM(str(tiny[0]), data_parallel_size=2, **ENGINE)
    assert not issubclass(DataParallelLLM, LLM)


def test_a_request_failing_mid_step_ends_alone_with_error(llm, monkeypatch):
    ps = prompts(3, seed=6)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    bad = llm.tokenizer.encode(ps[1])
    update = IncrementalDetokenizer.update

    def failing_update(self, token_ids):
        if self is victim[0]:
            raise RuntimeError("detokenizer exploded")
        return update(self, token_ids)

    victim = []
    monkeypatch.setattr(IncrementalDetokenizer, "update", failing_update)
    ids = [llm.add_request(p, GREEDY) for p in ps]
    victim.append(llm.engine._table.samples[f"{ids[1]}#0"].detokenizer)
    outs = {}
    while llm.has_unfinished_requests():
        outs |= {o.request_id: o for o in llm.step() if o.finished}
    assert outs[ids[1]].outputs[0].finish_reason == "error"
    assert "detokenizer exploded" in outs[ids[1]].error
    assert outs[ids[1]].prompt_token_ids == bad
    assert [outs[ids[0]].outputs[0].token_ids, outs[ids[2]].outputs[0].token_ids] == \
        [want[0], want[2]]
    assert outs[ids[0]].error is None and llm.stats()["num_errors"] >= 1
    assert_idle(llm)


def test_a_request_whose_sampling_inputs_fail_ends_alone(llm, monkeypatch):
    ps = prompts(2, seed=7)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    poisoned = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, seed=12345)
    runner = llm.engine.runner
    build = type(runner).sampling_tensors

    def failing(self, rows, pad_to):
        if any(r.params.seed == 12345 for r in rows):
            raise ValueError("a row's sampling inputs do not fit")
        return build(self, rows, pad_to)

    monkeypatch.setattr(type(runner), "sampling_tensors", failing)
    outs = llm.generate([ps[0], ps[1], ps[0]], [GREEDY, poisoned, GREEDY], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert "do not fit" in outs[1].error
    assert tokens([outs[0], outs[2]]) == [want[0], want[0]]
    assert_idle(llm)


def test_an_exception_inside_generate_aborts_exactly_its_requests(llm, monkeypatch):
    other = llm.add_request(prompts(1, seed=8)[0], GREEDY)
    core_step = type(llm.engine).step
    calls = []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return core_step(self)

    monkeypatch.setattr(type(llm.engine), "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(3, seed=9), SamplingParams(temperature=0, max_tokens=50),
                     use_tqdm=False)
    monkeypatch.undo()
    assert llm.engine.num_unfinished_requests() == 1 and llm.engine.is_live(other)
    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == [other]
    assert finished[0].outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_int4_default_value_group_fits_head_dim_40(tmp_path):
    from tiny_models import save_tiny_model, save_tokenizer

    save_tokenizer(tmp_path)
    save_tiny_model(tmp_path, "llama", hidden_size=80, num_attention_heads=2,
                    num_key_value_heads=1)
    with LLM(str(tmp_path), kv_cache_dtype="int4", **ENGINE) as eng:
        assert eng.engine.runner.kv_spec.group_size == 20
        out = eng.generate("It was", GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 12


# ---------------------------------------------------------------------- AsyncLLM


def test_async_llm_concurrent_coroutines_equal_generate(tiny, llm):
    ps = prompts(8, seed=10)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))

    async def one(engine, i):
        last = None
        async for out in engine.generate(ps[i], GREEDY, request_id=f"r{i}"):
            assert out.request_id == f"r{i}"
            last = out
        return last

    async def main():
        engine = AsyncLLM(str(tiny[0]), **ENGINE)
        try:
            outs = await asyncio.gather(*(one(engine, i) for i in range(len(ps))))
            stats = await engine.stats()
        finally:
            engine.shutdown()
        return outs, stats

    outs, stats = asyncio.run(main())
    assert tokens(outs) == want and all(o.finished for o in outs)
    assert (stats["num_running"], stats["kv_blocks_used"]) == (0, 0)


def test_async_llm_cancel_and_abort_free_blocks_within_a_step(tiny):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        engine = AsyncLLM(str(tiny[0]), **ENGINE)
        try:
            with pytest.raises(TypeError, match="cache_salt"):
                async for _ in engine.generate("x", GREEDY, cache_salt=3):
                    pass
            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate(prompts(1, seed=11)[0], long,
                                               request_id="cancelled"):
                    started.set()

            task = asyncio.ensure_future(consume())
            await started.wait()
            task.cancel()                         # a cancelled coroutine aborts its request
            with pytest.raises(asyncio.CancelledError):
                await task
            aborted = []

            async def run_abort():
                async for out in engine.generate(prompts(1, seed=12)[0], long, request_id="a"):
                    aborted.append(out)
                    if len(aborted) == 2:
                        await engine.abort("a")

            await run_abort()
            steps0 = engine.engine.runner.num_steps
            for _ in range(200):                  # the device thread frees them promptly
                stats = await engine.stats()
                if stats["kv_blocks_used"] == 0:
                    break
                await asyncio.sleep(0.01)
            return aborted, stats, engine.engine.runner.num_steps - steps0
        finally:
            engine.shutdown()

    aborted, stats, extra_steps = asyncio.run(main())
    assert aborted[-1].finished and aborted[-1].outputs[0].finish_reason == "abort"
    assert len(aborted[-1].outputs[0].token_ids) < 200
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert extra_steps <= 1
