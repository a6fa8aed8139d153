"""H2O retention through the engine on the tiny model: the step's attention mass drives which
blocks go (jaxkv/retention/h2o.py, jaxkv/attention/mass.py); a budget covering the sequence
equals full retention exactly, the grouped and reference paths agree under a small budget, the
pool stays at the budget, prefix-cache hits stay exact, and bad arguments are refused."""

import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.entrypoints.eval import retained_nll
from jaxkv.retention import FullRetention, H2ORetention
from tiny_models import TINY_ENGINE

H2O = dict(TINY_ENGINE, kv_retention="h2o", kv_budget_tokens=48, kv_sink_tokens=0)


def _greedy(engine, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [list(range(5, 75)), list(range(100, 113))]


def test_a_budget_covering_the_sequence_equals_full_retention(tiny):
    path, _ = tiny
    with LLM(str(path), **TINY_ENGINE) as engine:
        full = _greedy(engine, PROMPTS, 120)
    with LLM(str(path), **dict(H2O, kv_budget_tokens=256)) as engine:
        assert _greedy(engine, PROMPTS, 120) == full


def test_small_budget_grouped_equals_reference_and_stays_in_budget(tiny):
    path, _ = tiny
    runs = []
    for impl in ("grouped", "reference"):
        with LLM(str(path), **H2O, attention_impl=impl) as engine:
            core = engine.engine
            for p in PROMPTS:
                core.add_request({"prompt_token_ids": p},
                                 SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
            held, outs = [], {}
            while core.has_unfinished_requests():
                for rid, out in core.step().items():
                    if out.finished:
                        outs[rid] = out.outputs[0].token_ids
                state = core.scheduler_state
                core.check_invariants()
                for rid in state.running:
                    held.append(sum(1 for b in state.block_manager.block_table(rid) if b))
                    rs = state.requests[rid]   # scored from its first sampling step on
                    assert (rs.block_scores is not None) >= bool(rs.output_token_ids)
            runs.append([outs[k] for k in sorted(outs)])
            # 48 tokens = 6 blocks of 8, plus one step's blocks
            assert max(held) <= H2ORetention(budget_tokens=48).max_blocks(10**6, 64, 8, 70)
    assert runs[0] == runs[1]
    assert all(len(t) == 120 for t in runs[0])


def test_prefix_hits_under_h2o_stay_exact(tiny):
    path, _ = tiny
    with LLM(str(path), **H2O, prefix_caching="hash") as engine:
        first = _greedy(engine, PROMPTS[:1], 80)
        again = _greedy(engine, PROMPTS[:1], 80)
        assert engine.stats()["prefix_cache_hit_rate"] > 0
    assert again == first


def test_h2o_perplexity_protocol_scores_blocks(tiny):
    # retained_nll accumulates the mass of every token (chunk 1 <= observe) and drops by it;
    # a budget covering the text equals full retention, a small one differs and stays bounded
    path, _ = tiny
    ids = np.random.default_rng(5).integers(3, 400, size=200)
    with LLM(str(path), **TINY_ENGINE) as engine:
        runner = engine.engine.runner
        full = retained_nll(runner, ids, retention=FullRetention(), kv_cache_dtype="fp32",
                            chunk=1)
        big = retained_nll(runner, ids, retention=H2ORetention(budget_tokens=256),
                           kv_cache_dtype="fp32", chunk=1)
        small = retained_nll(runner, ids, retention=H2ORetention(budget_tokens=48),
                             kv_cache_dtype="fp32", chunk=1)
    np.testing.assert_allclose(big.nll, full.nll, atol=1e-5)
    assert np.abs(small.nll - full.nll).max() > 1e-3
    assert small.pool_blocks < 200 // 8


def test_bad_h2o_arguments(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        LLM(str(path), **dict(TINY_ENGINE, kv_retention="h2o"))
    with pytest.raises(ValueError, match="kv_budget_tokens=64 is used only"):
        LLM(str(path), **dict(TINY_ENGINE, kv_budget_tokens=64))
    with pytest.raises(ValueError, match="must exceed the recent window"):
        LLM(str(path), **dict(H2O, kv_budget_tokens=8, kv_sink_tokens=4))
