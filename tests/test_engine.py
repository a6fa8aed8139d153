"""The LLM engine end to end on a tiny HF checkpoint: parity with HF generate, preemption,
seeded sampling, compilation count, stop handling, streaming and bad input."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv import LLM  # noqa: E402
from jaxkv.sample.sampler import SamplingParams  # noqa: E402
from tiny_models import TINY_ENGINE, austen_prompts  # noqa: E402

ENGINE = TINY_ENGINE


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm


prompts = austen_prompts


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_generate_greedy_equals_transformers(tiny, llm):
    _, model = tiny
    ps = prompts(6)
    lens = [5, 40, 17, 1, 64, 23]
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n) for n in lens]
    outs = llm.generate(ps, params, use_tqdm=False)
    for p, o, n in zip(ps, outs, lens):
        assert o.prompt == p
        assert o.prompt_token_ids == llm.tokenizer.encode(p)
        assert o.outputs[0].token_ids == hf_greedy(model, o.prompt_token_ids, n)
        assert o.outputs[0].finish_reason == "length"
        assert o.metrics.ttft is not None and o.metrics.ttft >= 0
    assert llm.stats()["kv_blocks_used"] == 0


def test_tiny_kv_budget_preempts_and_matches_unconstrained(tiny, llm):
    ps = prompts(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    # 45 usable blocks of 8 tokens: a few of the 8 sequences fit at once
    with LLM(str(tiny[0]), **{**ENGINE, "num_kv_blocks": 46}) as small:
        outs = small.generate(ps, params, use_tqdm=False)
        stats = small.stats()
        assert stats["kv_blocks_free"] == 45
        small.engine.check_invariants()
    assert stats["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_kv_layouts_give_the_same_tokens(tiny, llm):
    """The CPU default (HND pools) and NHD pools give the same greedy tokens; the resolved
    layout follows the attention implementation and the format."""
    from jaxkv.config import EngineConfig
    from jaxkv.config.resolve import resolve

    assert llm.engine.runner.kv_spec.layout == "hnd"
    ps = prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    with LLM(str(tiny[0]), **{**ENGINE, "kv_layout": "nhd"}) as nhd:
        assert nhd.engine.runner.kv_spec.layout == "nhd"
        assert [o.outputs[0].token_ids for o in nhd.generate(ps, params, use_tqdm=False)] == want
    config = llm.engine.runner.model_config
    for kwargs, layout in ((dict(attention_impl="pallas"), "nhd"),
                           (dict(kv_cache_dtype="int8"), "nhd"),
                           (dict(attention_impl="reference"), "hnd")):
        engine = EngineConfig.from_kwargs(model=str(tiny[0]), **kwargs)
        assert resolve(engine, config).kv_layout == layout
    with pytest.raises(ValueError, match="kv_layout='hnd' holds float pools only"):
        LLM(str(tiny[0]), **{**ENGINE, "kv_cache_dtype": "int8", "kv_layout": "hnd"})


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm):
    ps = prompts(5, seed=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = llm.generate(ps[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        [ps[1], ps[2], ps[0], ps[3], ps[4]],
        [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 2 + [seeded]
        + [SamplingParams(temperature=0, max_tokens=7)] * 2, use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    again = llm.generate([ps[3], ps[0]], [SamplingParams(temperature=0.7, max_tokens=5), seeded],
                         use_tqdm=False)
    assert again[1].outputs[0].token_ids == alone
    # n samples with a seed equal the same samples (seed + i) run one by one
    n3 = llm.generate(ps[1], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                            ignore_eos=True), use_tqdm=False)[0]
    for i, comp in enumerate(n3.outputs):
        one = llm.generate(ps[1], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12,
                                                 ignore_eos=True), use_tqdm=False)[0]
        assert comp.index == i and comp.token_ids == one.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in n3.outputs}) > 1


def test_each_on_demand_compile_is_logged(tiny, caplog):
    with LLM(str(tiny[0]), **ENGINE) as engine, caplog.at_level("INFO", logger="jaxkv"):
        engine.generate(prompts(10, seed=3), SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)
        lines = [r.getMessage() for r in caplog.records if "compiled on demand" in r.getMessage()]
        assert len(lines) == engine.num_compilations() >= 2       # a prefill and a decode shape
        assert lines[0].startswith("step variant 1 (") and lines[-1].startswith(
            f"step variant {len(lines)} (")


def test_the_plan_and_each_compile_are_logged_before_they_start(tiny, caplog):
    with caplog.at_level("INFO", logger="jaxkv"), LLM(str(tiny[0]), **ENGINE) as engine:
        assert any(r.getMessage().startswith("KV pool: 95 blocks x 8 tokens = 760 tokens") and
                   "given num_gpu_blocks_override=96" in r.getMessage() for r in caplog.records)
        engine.generate(prompts(3, seed=3), SamplingParams(temperature=0, max_tokens=4),
                        use_tqdm=False)
        starts = [r.getMessage() for r in caplog.records
                  if r.getMessage().startswith("compiling the step for")]
        assert len(starts) == engine.num_compilations() >= 2      # a prefill and a decode
        caplog.clear()
        assert engine.warmup([(64, 8)]) == 1                       # only the shapes given
        assert "compiling 1 step variants (64x8)" in caplog.text
        assert "compiled 1 step variants in" in caplog.text


def test_compilation_count_is_flat_in_steady_state(tiny):
    with LLM(str(tiny[0]), **ENGINE, warmup=True) as engine:
        compiled = engine.num_compilations()
        assert compiled == 2   # (16, 8) and (64, 8)
        ps = prompts(10, seed=3)
        engine.generate(ps, SamplingParams(temperature=0.8, max_tokens=20), use_tqdm=False)
        engine.generate(ps[::-1], SamplingParams(temperature=0, max_tokens=9), use_tqdm=False)
        assert engine.num_compilations() == compiled


def test_decode_bucket_runs_decode_steps_on_its_rows_with_the_same_tokens(tiny, llm, caplog):
    ps = prompts(3, seed=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    with LLM(str(tiny[0]), **ENGINE, decode_buckets=(4,)) as engine, \
            caplog.at_level("INFO", logger="jaxkv"):
        assert engine.engine.runner.sched_config.step_shapes()[1] == [(4, 4)]
        outs = engine.generate(ps, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        shapes = [r.getMessage().split("(")[1].split(", width")[0] for r in caplog.records
                  if "compiled on demand" in r.getMessage()]
        assert "4 tokens, 4 sequences" in shapes      # 3 decodes on 4 rows, not (16, 8)
        assert engine.warmup() == 3                    # (16, 8), (64, 8) and (4, 4)
        engine.generate(ps[::-1], params, use_tqdm=False)
        assert engine.num_compilations() == 3


def test_pallas_decode_steps_run_split_k_with_the_same_tokens(tiny, llm, caplog):
    """On the Pallas path (interpret mode) a decode-only step runs a variant of its own whose
    attention is the split-K decode kernel, with the default CPU path's tokens; warmup compiles
    it for every decode shape, and a steady state compiles nothing more."""
    ps = prompts(3, seed=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    with LLM(str(tiny[0]), **ENGINE, decode_buckets=(4,), attention_impl="pallas",
             interpret=True) as engine, caplog.at_level("INFO", logger="jaxkv"):
        outs = engine.generate(ps, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert "4 tokens, 4 sequences (width 1, 0 logprobs, decode-only True)" in caplog.text
        assert "(width 1, 0 logprobs, decode-only False)" in caplog.text       # the prefill
        runner = engine.engine.runner
        kernels = {d: str(runner._step_fn.trace(runner.params, runner.cache,
                                                *runner._padded_args(16, 8), num_logprobs=0,
                                                decode_only=d).jaxpr) for d in (False, True)}
        assert "jaxkv_paged_decode_attention" in kernels[True]
        assert "jaxkv_ragged_paged_attention" not in kernels[True]
        assert "jaxkv_ragged_paged_attention" in kernels[False]
        assert engine.warmup() == 4     # (16, 8), (64, 8); decode-only (4, 4) and (16, 8)
        engine.generate(ps[::-1] + ps, params, use_tqdm=False)
        assert engine.num_compilations() == 4


@pytest.mark.parametrize("retention", [
    dict(kv_retention="h2o", kv_budget_tokens=32, kv_sink_tokens=0),      # the kernel's lse
    pytest.param(dict(kv_retention="streaming", kv_sink_tokens=4, kv_window_tokens=28),
                 marks=pytest.mark.slow)])            # sink queries: also test_pallas.py
def test_pallas_split_k_decode_keeps_retention_tokens(tiny, retention):
    """H2O's block mass (from the decode kernel's lse) and StreamingLLM's window, sinks and sink
    queries through split-K decode give the grouped path's tokens."""
    ps = prompts(3, seed=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = {}
    for impl in ("grouped", "pallas"):
        with LLM(str(tiny[0]), **ENGINE, **retention, attention_impl=impl,
                 interpret=impl == "pallas") as engine:
            got[impl] = [o.outputs[0].token_ids
                         for o in engine.generate(ps, params, use_tqdm=False)]
    assert got["pallas"] == got["grouped"]


def test_generation_with_penalties_does_not_recompile_as_sequences_grow(tiny):
    with LLM(str(tiny[0]), **ENGINE) as engine:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                repetition_penalty=1.3, frequency_penalty=0.2)
        engine.generate(prompts(2, seed=1), params, use_tqdm=False)   # compiles the variant
        compiled = engine.num_compilations()
        # histories grow from ~10 to ~110 tokens: past the 16, 32 and 64 length buckets
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                              repetition_penalty=1.3, frequency_penalty=0.2)
        engine.generate(prompts(2, seed=2), long, use_tqdm=False)
        assert engine.num_compilations() == compiled


def test_stop_strings_stop_tokens_logprobs(llm):
    p = prompts(1, seed=4)[0]
    base = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                          logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(base.logprobs) == 30
    for tok, entry in zip(base.token_ids, base.logprobs):
        assert tok in entry and len(entry) <= 4
        assert entry[tok] == pytest.approx(max(entry.values()), abs=1e-6)   # greedy = top-1
    np.testing.assert_allclose(base.cumulative_logprob,
                               sum(e[t] for t, e in zip(base.token_ids, base.logprobs)),
                               rtol=1e-5, atol=1e-5)
    # stop token: generation ends at its first occurrence, the token is kept
    stop_tok = base.token_ids[10]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                         stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # stop string: the text is trimmed before it
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 3]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                         stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[:base.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == base.token_ids[:len(out.token_ids)]
    kept = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                          stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]
    assert kept.token_ids == out.token_ids and kept.stop_reason == stop


def test_streaming_abort_and_chat(llm):
    ps = prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(ps[0], params, use_tqdm=False)[0].outputs[0]
    chunks = list(llm.stream(ps[0], params))
    assert chunks[-1].finished and chunks[-1].outputs[0].token_ids == want.token_ids
    assert [len(c.outputs[0].token_ids) for c in chunks] == list(range(1, 13))
    # abort of a running request frees its blocks at once; the other one keeps going
    a = llm.add_request(ps[1], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    b = llm.add_request(ps[2], params)
    llm.step()
    used = llm.stats()["kv_blocks_used"]
    llm.abort_request(a)
    assert llm.stats()["kv_blocks_used"] < used
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.finished]
    # the aborted request's final output comes out of the next step, then b's
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [(a, "abort"),
                                                                          (b, "length")]
    replies = llm.chat([{"role": "user", "content": "Hello"}],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert replies[0].prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("prompt,params,field", [
    ("", SamplingParams(), "prompt"),
    ({"prompt_token_ids": []}, SamplingParams(), "prompt_token_ids"),
    ("x " * 300, SamplingParams(max_tokens=10), "max_model_len"),
    ({"prompt_token_ids": [1, 2, 10_000]}, SamplingParams(), "vocab_size"),
    ("hi", SamplingParams(logprobs=50), "logprobs"),
])
def test_bad_input_names_the_field_and_keeps_serving(llm, prompt, params, field):
    good = llm.add_request(prompts(1, seed=6)[0], SamplingParams(temperature=0, max_tokens=6,
                                                                 ignore_eos=True))
    with pytest.raises(ValueError, match=field):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert llm.stats()["num_waiting"] + llm.stats()["num_running"] == 1
    done = []
    while llm.has_unfinished_requests():
        done += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in done] == [good] and len(done[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1.0), "temperature"), (dict(stop=3), "stop"), (dict(n=0), "n"),
])
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_arguments_are_checked(tiny):
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny[0]), dtype="int3")
    with pytest.raises(ValueError, match="attention_impl"):
        LLM(str(tiny[0]), attention_impl="cuda")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(tiny[0]), **{**ENGINE, "max_num_seqs": 0})
