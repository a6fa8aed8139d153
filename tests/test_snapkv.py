"""SnapKV and random eviction (jaxkv/retention/snapkv.py, random_evict.py): the kept block ids
against brute-force numpy references, and through the engine on the tiny model: a budget
covering the prompt equals full retention, the grouped and reference paths agree under a small
budget, the prompt is compressed exactly once by the observation window's scores, prefix-cache
hits stay exact, and bad arguments are refused naming the field."""

import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.config import CacheConfig, RetentionArgs, SchedulerConfig
from jaxkv.entrypoints.eval import retained_nll
from jaxkv.retention import (FullRetention, H2ORetention, RandomRetention, SnapKVRetention,
                             from_args)
from jaxkv.retention.snapkv import pool_blocks
from jaxkv.sched.scheduler import add_request, check_invariants, schedule, update
from jaxkv.sched.state import Request, StopSpec, init_state
from tiny_models import TINY_ENGINE

SNAP = dict(TINY_ENGINE, kv_retention="snapkv", kv_budget_tokens=48, kv_observation_tokens=16,
            kv_sink_tokens=4)
RANDOM = dict(TINY_ENGINE, kv_retention="random", kv_budget_tokens=48, kv_sink_tokens=4)


def snapkv_reference(scores, prompt, budget, sinks, window, kernel, block_size, pooling):
    """Brute-force SnapKV at block granularity: the set of dropped logical blocks.

    Every prompt block between the sink blocks and the observation window's first block is a
    candidate; its pooled score is the max (or the zero-padded mean) of the raw scores of the
    candidates within ``round((kernel // 2) / block_size)`` blocks (halves up); the kept are the
    ``budget blocks - protected`` best by (pooled, raw, younger first)."""
    nb = -(-prompt // block_size)
    first = -(-sinks // block_size)
    win = max(0, prompt - window) // block_size
    cands = list(range(first, win))
    if nb <= budget // block_size:
        return set()
    r = int(np.floor((kernel // 2) / block_size + 0.5))
    pooled = {}
    for j in cands:
        near = [scores[k] for k in range(j - r, j + r + 1) if k in cands]
        pooled[j] = max(near) if pooling == "max" else sum(near) / (2 * r + 1)
    keep_n = max(0, budget // block_size - (nb - len(cands)))
    order = np.lexsort(([j for j in cands], [scores[j] for j in cands],
                        [pooled[j] for j in cands]))[::-1]      # best first
    return {cands[i] for i in order[keep_n:]}


def test_snapkv_the_documented_example():
    policy = SnapKVRetention(budget_tokens=24, sink_tokens=4, window_tokens=8)
    scores = np.array([50, .1, .9, .05, 3, 3, 3])
    assert policy.drops(26, tuple(range(1, 8)), scores, 4, prompt_tokens=26) == (3,)
    # at block size 16 a 7-token kernel pools nothing: the lowest raw score goes
    scores = np.array([50, .9, .1, .05, .5, 3, 3, 3])
    policy = SnapKVRetention(budget_tokens=96, sink_tokens=4, window_tokens=32)
    assert policy.drops(120, tuple(range(1, 9)), scores, 16, prompt_tokens=120) == (3, 2)


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_drops_exactly_the_brute_force_blocks(pooling):
    rng = np.random.default_rng(0)
    for trial in range(300):
        bs = int(rng.choice([2, 4, 8]))
        prompt = int(rng.integers(1, 120))
        window = int(rng.integers(1, 24))
        sinks = int(rng.integers(0, 9))
        kernel = int(rng.choice([1, 3, 7, 17]))
        protected = -(-sinks // bs) + -(-window // bs) + 1
        budget = int(rng.integers((protected + 1) * bs, (protected + 12) * bs))
        policy = SnapKVRetention(budget_tokens=budget, sink_tokens=sinks, window_tokens=window,
                                 pool_kernel=kernel, pooling=pooling)
        policy.check_block_size(bs, 0)
        nb = -(-prompt // bs)
        # scores with ties (rounded) to exercise the tie-breaks
        scores = np.round(rng.random(nb), 1)
        table = tuple(range(1, nb + 1))
        at = prompt + int(rng.integers(0, 3))      # the first decode (or later)
        table = table + tuple(range(nb + 1, nb + 1 + (-(-at // bs) - nb)))
        got = policy.drops(at, table, scores, bs, prompt_tokens=prompt)
        want = snapkv_reference(scores, prompt, budget, sinks, window, kernel, bs, pooling)
        assert set(got) == want, (trial, bs, prompt, window, sinks, kernel, budget)
        assert len(got) == len(set(got))
        # once compressed nothing more goes, and every drop is one may_drop allows
        kept = tuple(0 if j in want else b for j, b in enumerate(table))
        assert policy.drops(at + 5, kept, scores, bs, prompt_tokens=prompt) == ()
        assert all(policy.may_drop(at, j, bs) for j in want)
        assert sum(1 for b in kept[:nb] if b) <= max(budget // bs, 0) or not want


def test_pool_blocks_against_numpy():
    x = np.array([1., 5, 2, 0, 0, 7])
    np.testing.assert_allclose(pool_blocks(x, 1, "max"), [5, 5, 5, 2, 7, 7], atol=0)
    np.testing.assert_allclose(pool_blocks(x, 1, "avg"), np.convolve(x, np.ones(3), "same") / 3,
                               atol=1e-12)
    np.testing.assert_allclose(pool_blocks(x, 0, "max"), x, atol=0)


def test_snapkv_without_scores_keeps_the_latest_prompt_blocks_and_bounds():
    policy = SnapKVRetention(budget_tokens=32, sink_tokens=4, window_tokens=8)
    # 20 blocks of 4; sink block 0, window blocks 18, 19; 8 kept in all -> 5 candidates kept
    assert policy.drops(80, tuple(range(1, 21)), None, 4, prompt_tokens=80) == tuple(range(1, 13))
    assert policy.max_blocks(80, 8, 4, 80) == 20                  # the prompt first
    assert policy.max_blocks(200, 8, 4, 80) == 8 + 50 - 20        # then budget + generated
    assert policy.max_blocks(30, 8, 4, 20) == 8                   # never more than the sequence
    with pytest.raises(ValueError, match="prompt_tokens"):
        policy.drops(80, tuple(range(1, 21)), None, 4)


def random_reference(seed, at, table, scores, budget, sinks, recent, bs):
    """Random eviction as documented: unprotected kept blocks in a uniformly random order drawn
    from ``default_rng((seed, at))``, the first ``excess`` go."""
    first, last = -(-sinks // bs), max(0, at - recent) // bs
    kept = [j for j, b in enumerate(table) if b]
    cands = [j for j in kept if first <= j < last]
    excess = len(kept) - budget // bs
    if excess <= 0:
        return set()
    perm = np.random.default_rng((seed, at)).permutation(len(cands))
    return {cands[i] for i in np.argsort(perm)[:excess]}


def test_random_drops_are_seeded_and_exact():
    rng = np.random.default_rng(1)
    counts = np.zeros(40)
    for trial in range(400):
        policy = RandomRetention(budget_tokens=64, sink_tokens=4, seed=trial % 3)
        n = int(rng.integers(10, 40))
        table = tuple(0 if rng.random() < .2 else j + 1 for j in range(n))
        at = 4 * n
        got = policy.drops(at, table, None, 4)
        assert got == policy.drops(at, table, rng.random(n), 4)    # scores are ignored
        assert set(got) == random_reference(trial % 3, at, table, None, 64, 4, 32, 4)
        assert all(table[j] and 1 <= j < (at - 32) // 4 for j in got)
        kept = sum(1 for b in table if b)
        assert len(got) == max(0, kept - 16)
        counts[list(got)] += 1
    # no candidate is systematically spared: each is dropped in a fair share of the trials
    assert counts[1:20].min() > 0.3 * counts[1:20].mean()
    assert RandomRetention(budget_tokens=64, seed=0).drops(160, tuple(range(1, 41)), None, 4) != \
        RandomRetention(budget_tokens=64, seed=1).drops(160, tuple(range(1, 41)), None, 4)


def test_from_args_and_bad_arguments():
    policy = from_args(RetentionArgs(kv_retention="snapkv", kv_budget_tokens=256,
                                 kv_observation_tokens=24))
    assert policy == SnapKVRetention(budget_tokens=256, sink_tokens=4, window_tokens=24)
    assert policy.attention.observe == 24 and policy.history_dependent
    assert from_args(RetentionArgs(kv_retention="snapkv", kv_budget_tokens=256)).window_tokens == 32
    policy = from_args(RetentionArgs(kv_retention="random", kv_budget_tokens=256))
    assert policy == RandomRetention(budget_tokens=256, sink_tokens=4)
    assert policy.observe == 0 and policy.attention.observe == 0 and policy.history_dependent
    cases = [(dict(kv_retention="snapkv"), "kv_budget_tokens"),
             (dict(kv_retention="random"), "kv_budget_tokens"),
             (dict(kv_retention="h2o", kv_budget_tokens=64, kv_observation_tokens=8),
              "kv_observation_tokens=8 is used only"),
             (dict(kv_retention="snapkv", kv_budget_tokens=30, kv_sink_tokens=4),
              "kv_budget_tokens=30 must exceed"),
             (dict(kv_retention="random", kv_budget_tokens=8, kv_sink_tokens=4),
              "kv_budget_tokens=8 must exceed")]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            from_args(RetentionArgs(**kw))
    for kw, match in [(dict(pool_kernel=4), "pool_kernel=4"), (dict(pooling="sum"), "pooling"),
                      (dict(window_tokens=0), "kv_observation_tokens=0")]:
        with pytest.raises(ValueError, match=match):
            SnapKVRetention(budget_tokens=64, **kw)
    with pytest.raises(ValueError, match="kv_budget_tokens=40 must hold more than the 5"):
        SnapKVRetention(budget_tokens=40, sink_tokens=4, window_tokens=17).check_block_size(8, 0)
    with pytest.raises(ValueError, match="kv_observation_tokens=16 must cover the KIVI"):
        SnapKVRetention(budget_tokens=256, window_tokens=16).check_block_size(16, 2)


@pytest.mark.parametrize("policy, num_blocks", [
    (SnapKVRetention(budget_tokens=20, sink_tokens=2, window_tokens=6), 14),
    (RandomRetention(budget_tokens=16, sink_tokens=0), 22)], ids=["snapkv", "random"])
def test_forks_and_preemption_keep_invariants(policy, num_blocks):
    # the pure scheduler with synthetic block mass: forks, recompute preemption in a small
    # pool (admission waits for a whole prompt's blocks, so a pool where the kept blocks
    # outgrow it), invariants after every schedule and update, every request finishing whole
    cc = CacheConfig(block_size=4, num_blocks=num_blocks, retention=policy)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=400)

    def req(rid, prompt, **kw):
        return Request(request_id=rid, prompt_token_ids=tuple(prompt),
                       stop=StopSpec(max_tokens=30, ignore_eos=True), **kw)

    state = init_state(cc)
    for i in range(5):
        state = add_request(state, req(f"r{i}", range(10 * i, 10 * i + 30)), sc)
    state = add_request(state, req("r0#1", range(0, 30), fork_of="r0"), sc)
    rng = np.random.default_rng(0)
    preempted, dropped, done = 0, 0, {}
    while state.requests:
        state, plan = schedule(state, sc, {})
        preempted += len(plan.preempted_ids)
        check_invariants(state, sc)
        dropped = max([dropped] + [sum(1 for b in state.block_manager.block_table(r) if b == 0)
                                   for r in state.running])
        width = max([len(s.block_table) for s in plan.seqs], default=1)
        state = update(state, plan, [7] * len(plan.seqs),
                       block_mass=rng.random((len(plan.seqs), width)))
        check_invariants(state, sc)
        done.update(state.finished)
    assert (preempted > 0, dropped > 0) == (True, True)
    assert sorted(done) == ["r0", "r0#1", "r1", "r2", "r3", "r4"]
    assert all(len(rs.output_token_ids) == 30 for rs in done.values())
    assert state.block_manager.num_free_blocks == num_blocks - 1


@pytest.mark.parametrize("policy", [SnapKVRetention(budget_tokens=20, sink_tokens=2, window_tokens=6),
                                    H2ORetention(budget_tokens=20, sink_tokens=2)],
                         ids=["snapkv", "h2o"])
def test_a_step_observes_exactly_when_a_sampling_chunk_wants_scores(policy):
    # a 30-token prompt over the 20-token budget (chunked: 16 tokens a step) and a 12-token one
    # within it. SnapKV wants the mass only of the chunk that ends the long prompt (it
    # compresses once, then decodes without it; the short prompt never compresses); H2O wants
    # it at every step that samples, and no step of chunks inside a prompt samples
    cc = CacheConfig(block_size=4, num_blocks=64, retention=policy)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=100)
    state = init_state(cc)
    for rid, n in (("long", 30), ("short", 12)):
        state = add_request(state, Request(request_id=rid, prompt_token_ids=tuple(range(n)),
                                           stop=StopSpec(max_tokens=4, ignore_eos=True)), sc)
    rng = np.random.default_rng(0)
    observed = []
    while state.requests:
        state, plan = schedule(state, sc, {})
        ends_long_prompt = any(s.request_id == "long" and s.start_pos < 30 <= s.start_pos
                               + len(s.token_ids) for s in plan.seqs)
        want = ends_long_prompt if policy.name == "snapkv" else any(s.sample for s in plan.seqs)
        observed.append((plan.observe, [(s.request_id, s.start_pos, len(s.token_ids))
                                        for s in plan.seqs]))
        assert plan.observe == want, observed
        width = max(len(s.block_table) for s in plan.seqs)
        state = update(state, plan, [7] * len(plan.seqs),
                       block_mass=rng.random((len(plan.seqs), width)) if plan.observe else None)
    steps = [seqs for obs, seqs in observed if obs]
    if policy.name == "snapkv":   # one step: the one whose chunk ends the long prompt
        assert len(steps) == 1 and ("long", 16, 14) in steps[0]
    else:                         # every step but the first (two prompt chunks, no sample)
        assert len(steps) == len(observed) - 1


# ---- through the engine -----------------------------------------------------------------------

def _greedy(engine, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [list(range(5, 65)), list(range(100, 113)), list(range(200, 250))]


@pytest.mark.parametrize("kw", [SNAP, RANDOM], ids=["snapkv", "random"])
def test_a_budget_covering_the_prompt_equals_full_retention(tiny, kw):
    path, _ = tiny
    with LLM(str(path), **TINY_ENGINE) as engine:
        full = _greedy(engine, PROMPTS, 40)
    budget = 64 if kw is SNAP else 256     # SnapKV never drops generated tokens
    with LLM(str(path), **dict(kw, kv_budget_tokens=budget)) as engine:
        assert _greedy(engine, PROMPTS, 40) == full


def _run(path, kw, impl, prompts, n):
    """Outputs, per request (prompt length, first drop, the scores its first drop was computed
    from (the state before that step), the block table right after it), and the blocks held
    after every step; under SnapKV checks that the prompt's drops never change after that."""
    with LLM(str(path), **kw, attention_impl=impl) as engine:
        core = engine.engine
        for p in prompts:
            core.add_request({"prompt_token_ids": p},
                             SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        outs, compressed, held = {}, {}, []
        before = {}
        while core.has_unfinished_requests():
            state = core.scheduler_state
            before = {rid: rs.block_scores for rid, rs in state.requests.items()
                      if rs.first_drop is None and rs.block_scores is not None}
            for rid, out in core.step().items():
                if out.finished:
                    outs[rid] = out.outputs[0].token_ids
            core.check_invariants()
            state = core.scheduler_state
            for rid in state.running:
                rs = state.requests[rid]
                table = state.block_manager.block_table(rid)
                held.append(sum(1 for b in table if b))
                if rs.first_drop is not None and rid not in compressed:
                    compressed[rid] = (len(rs.request.prompt_token_ids), rs.first_drop,
                                       before.get(rid), table)
                elif rid in compressed and kw is SNAP:   # compressed once
                    nb = -(-compressed[rid][0] // 8)
                    assert [b == 0 for b in table[:nb]] == \
                        [b == 0 for b in compressed[rid][3][:nb]]
        return [outs[k] for k in sorted(outs)], compressed, held


def test_snapkv_small_budget_grouped_equals_reference_and_compresses_once(tiny):
    path, _ = tiny
    policy = from_args(RetentionArgs(**{k: SNAP[k] for k in
                                        ("kv_retention", "kv_budget_tokens",
                                         "kv_observation_tokens", "kv_sink_tokens")}))
    runs = []
    for impl in ("grouped", "reference"):
        outs, compressed, held = _run(path, SNAP, impl, PROMPTS[::2], 60)
        runs.append(outs)
        assert len(compressed) == 2            # both long prompts were compressed
        for prompt, first_drop, scores, table in compressed.values():
            assert first_drop == prompt        # at the end of prefill
            dropped = {j for j, b in enumerate(table) if b == 0}
            want = snapkv_reference(scores, prompt, 48, 4, 16, 7, 8, "max")
            assert dropped == want and want
        assert max(held) <= policy.max_blocks(60 + 60, 64, 8, 60)
    assert runs[0] == runs[1]
    assert all(len(t) == 60 for t in runs[0])


def test_snapkv_decodes_without_the_block_mass_and_gives_the_same_tokens(tiny, monkeypatch):
    # the reference: every sampling step computes the mass, as before steps could skip it
    path, _ = tiny
    with LLM(str(path), **SNAP) as engine:
        blind = _greedy(engine, PROMPTS, 40)
        runner = engine.engine.runner
        assert runner._blind_step_fn._cache_size() > 0   # the decode steps ran without it
    monkeypatch.setattr(SnapKVRetention, "wants_scores", lambda self, *a: True)
    with LLM(str(path), **SNAP) as engine:
        assert engine.engine.runner._blind_step_fn._cache_size() == 0
        assert _greedy(engine, PROMPTS, 40) == blind


def test_random_engine_is_deterministic_and_in_budget(tiny):
    path, _ = tiny
    a, _, held = _run(path, RANDOM, "grouped", PROMPTS, 60)
    b, _, _ = _run(path, RANDOM, "reference", PROMPTS, 60)
    assert a == b
    assert max(held) <= RandomRetention(budget_tokens=48, sink_tokens=4).max_blocks(
        10**6, 64, 8, 60)


@pytest.mark.parametrize("kw", [SNAP, RANDOM], ids=["snapkv", "random"])
def test_prefix_hits_stay_exact(tiny, kw):
    path, _ = tiny
    with LLM(str(path), **kw, prefix_caching="hash") as engine:
        first = _greedy(engine, PROMPTS[:1], 40)
        again = _greedy(engine, PROMPTS[:1], 40)
        assert engine.stats()["prefix_cache_hit_rate"] > 0
    assert again == first


def test_snapkv_hit_leaves_the_observation_window_to_compute(tiny):
    # the 60-token prompt hits 40 cached tokens (5 blocks of 8 below 60 - 16), not 56
    path, _ = tiny
    with LLM(str(path), **SNAP, prefix_caching="hash") as engine:
        _greedy(engine, PROMPTS[:1], 4)
        core = engine.engine
        core.add_request({"prompt_token_ids": PROMPTS[0]},
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        core.step()
        (rs,) = core.scheduler_state.requests.values()
        assert rs.num_cached_tokens == 40


@pytest.mark.slow
def test_retained_nll_prompt_phase(tiny):
    # a budget covering the prompt == full retention; a small one differs and fits the pool
    path, _ = tiny
    ids = np.random.default_rng(5).integers(3, 400, size=200)
    with LLM(str(path), **TINY_ENGINE) as engine:
        runner = engine.engine.runner
        full = retained_nll(runner, ids, retention=FullRetention(), kv_cache_dtype="fp32",
                            chunk=4, prompt_tokens=150)
        kw = dict(kv_cache_dtype="fp32", chunk=4, prompt_tokens=150)
        big = retained_nll(runner, ids, retention=SnapKVRetention(budget_tokens=152), **kw)
        small = retained_nll(runner, ids, retention=SnapKVRetention(budget_tokens=48,
                                                                    window_tokens=16), **kw)
        with pytest.raises(ValueError, match="prompt_tokens"):
            retained_nll(runner, ids, retention=SnapKVRetention(budget_tokens=48), chunk=4,
                         kv_cache_dtype="fp32")
    np.testing.assert_allclose(big.nll, full.nll, atol=1e-5)
    np.testing.assert_array_equal(big.argmax, full.argmax)
    np.testing.assert_allclose(small.nll[:150], full.nll[:150], atol=1e-5)  # the prompt itself
    assert np.abs(small.nll[150:] - full.nll[150:]).max() > 1e-3
    assert small.peak_blocks <= small.pool_blocks == 19     # the prompt, computed whole first


def test_combinations_refused(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="kv_observation_tokens=8 must cover the KIVI"):
        LLM(str(path), **dict(SNAP, kv_observation_tokens=8, kv_budget_tokens=64,
                              kv_cache_dtype="int4", kv_residual_blocks=2))

