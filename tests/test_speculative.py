"""Speculative decoding: multi-token scheduler steps (rewind, truncation, stop rules inside an
accepted run, prefix-cache registration of verified tokens only) checked against a
non-speculative run of an oracle model after every step; the rejection sampler's distribution;
the n-gram proposer; and the engine on the tiny model: greedy and seeded outputs equal to
non-speculative decoding with n-gram and random drafts, tables and prefix cache after every
step, stops inside accepted runs, the stats, the Pallas kernel on verify steps; the adaptive
draft length (the fixed-cost rule, the step-time model, the whole-step allocation against brute
force); the engine's sampled distribution with drafts (chi-square against HF transformers)."""

import random

import numpy as np
import pytest

from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.sched.scheduler import (accepted_tokens, add_request, check_invariants, decoding_ids,
                                   schedule, update)
from jaxkv.sched.state import Request, StopSpec, init_state
from oracle_proposer import OracleProposer

VOCAB = 40


def oracle(history):
    """A deterministic 'greedy model' over token histories: the next token."""
    return hash(tuple(history[-3:])) % VOCAB


def configs(*, num_blocks=64, block_size=4, budget=32, prefix_caching="hash", max_num_seqs=8,
            max_model_len=64):
    return (CacheConfig(block_size=block_size, num_blocks=num_blocks,
                        prefix_caching=prefix_caching),
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len))


def req(rid, prompt, max_tokens=12, **stop):
    return Request(request_id=rid, prompt_token_ids=tuple(prompt),
                   stop=StopSpec(max_tokens=max_tokens, **stop))


def verify(state, plan):
    """What the device step returns under the oracle: per seq, the target token after each of
    its known token and drafts, cut after the first draft that differs from its target."""
    out = []
    for seq in plan.seqs:
        if not seq.sample:
            out.append(0)
            continue
        rs = state.requests[seq.request_id]
        history = list(rs.token_ids(0, rs.num_tokens))
        drafts = seq.token_ids[len(seq.token_ids) - seq.num_drafts:]
        tokens = []
        for j in range(seq.num_drafts + 1):
            tokens.append(oracle(history + list(drafts[:j])))
            if j == seq.num_drafts or drafts[j] != tokens[-1]:
                break
        out.append(tokens)
    return out


def snapshot(state, request_id):
    """Per-request state that must not depend on speculation at a given token count."""
    rs, bm = state.requests[request_id], state.block_manager
    tokens = rs.token_ids(0, rs.num_tokens)
    return (rs.num_computed_tokens, len(bm.block_table(request_id)),
            bm.num_registered(request_id), len(bm.lookup(tokens)[0]))


def run(cc, sc, requests, propose=None, check=None):
    """Steps the requests to the end; ``propose(state) -> drafts``; ``check(state, plan)`` after
    every step. Returns ({id: output tokens}, {id: finish reason}, final state, (drafts
    verified, drafts accepted))."""
    state = init_state(cc)
    for r in requests:
        state = add_request(state, r, sc)
    done, drafted, accepted = {}, 0, 0
    while state.requests or state.finished:
        state, plan = schedule(state, sc, propose(state) if propose else {})
        check_invariants(state, sc)
        tokens = verify(state, plan)
        drafted += plan.num_drafts
        accepted += sum(len(t) - 1 for t, s in zip(tokens, plan.seqs) if s.num_drafts)
        state = update(state, plan, tokens)
        check_invariants(state, sc)
        done.update({i: rs for i, rs in state.finished.items()})
        if check:
            check(state, plan)
    return ({i: rs.output_token_ids for i, rs in done.items()},
            {i: rs.finish_reason for i, rs in done.items()}, state, (drafted, accepted))


class SwitchingProposer:
    """Proposes the oracle's tokens while ``right``, else a token outside the vocabulary."""

    def __init__(self, right: bool):
        self.right = right

    def propose(self, token_ids, num_drafts):
        history, out = list(token_ids), []
        for _ in range(num_drafts):
            out.append(oracle(history + out) if self.right else VOCAB + 1)
        return out


def oracle_proposer(k, p_correct, seed):
    """Drafts for every running decode: the oracle's token with probability ``p_correct``,
    else a random one (so accepted runs of every length and rejections all happen)."""
    rng = random.Random(seed)

    def propose(state):
        drafts = {}
        for i in decoding_ids(state):
            rs = state.requests[i]
            history, draft = list(rs.token_ids(0, rs.num_tokens)), []
            for _ in range(rng.randint(0, k)):
                token = oracle(history + draft)
                draft.append(token if rng.random() < p_correct else rng.randrange(VOCAB))
            drafts[i] = draft
        return drafts
    return propose


def record_run(cc, sc, requests):
    """The non-speculative run, with every request's snapshot at every token count."""
    seen = {}

    def check(state, plan):
        for i in decoding_ids(state):
            seen[i, state.requests[i].num_tokens] = snapshot(state, i)
            seen[i, state.requests[i].num_tokens, "table"] = state.block_manager.block_table(i)
    return run(cc, sc, requests, check=check), seen


@pytest.mark.parametrize("seed", range(6))
def test_random_drafts_equal_the_non_speculative_run_after_every_step(seed):
    rng = random.Random(seed)
    requests = [req(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))],
                    max_tokens=rng.randint(1, 30), eos_token_ids=(7,) if i % 2 else ())
                for i in range(rng.randint(1, 5))]
    cc, sc = configs(budget=rng.choice([8, 16, 32]))
    (want, want_reasons, ref_state, _), seen = record_run(cc, sc, requests)
    single = len(requests) == 1
    checked = []

    def check(state, plan):
        for i in decoding_ids(state):
            key = (i, state.requests[i].num_tokens)
            assert snapshot(state, i) == seen[key], key
            if single:   # nothing else allocates: even the physical blocks agree
                assert state.block_manager.block_table(i) == seen[(*key, "table")]
            checked.append(key)

    got, reasons, state, (drafted, accepted) = run(cc, sc, requests,
                                                    oracle_proposer(5, 0.6, seed), check)
    assert got == want and reasons == want_reasons
    assert 0 < accepted < drafted or sum(map(len, want.values())) < 8
    bm, ref = state.block_manager, ref_state.block_manager
    assert bm.num_free_blocks == ref.num_free_blocks == cc.num_blocks - 1
    assert bm.num_cached_blocks == ref.num_cached_blocks
    for r in requests:   # the same contents are cached
        tokens = r.prompt_token_ids + got[r.request_id]
        assert len(bm.lookup(tokens)[0]) == len(ref.lookup(tokens)[0])
    assert checked or all(len(t) <= 1 for t in want.values())


def test_tight_pool_with_preemption_loses_nothing():
    rng = random.Random(11)
    requests = [req(f"r{i}", [rng.randrange(VOCAB) for _ in range(10)], max_tokens=20)
                for i in range(6)]
    cc, sc = configs(num_blocks=20, budget=16)
    (want, _, _, _), _ = record_run(cc, sc, requests)
    got, _, state, (drafted, accepted) = run(cc, sc, requests, oracle_proposer(6, 0.7, 3))
    assert got == want and 0 < accepted < drafted
    assert state.block_manager.num_free_blocks == cc.num_blocks - 1


def test_decode_carries_drafts_and_update_rewinds_over_the_rejected():
    cc, sc = configs(block_size=4, budget=8, prefix_caching=None)
    state = add_request(init_state(cc), req("a", (1, 2, 3), max_tokens=10), sc)
    state, plan = schedule(state, sc)
    state = update(state, plan, [10])                       # tokens 1 2 3 10, computed 3
    state, plan = schedule(state, sc, {"a": (11, 12, 13, 14, 15)})
    (seq,) = plan.seqs
    assert (seq.token_ids, seq.start_pos, seq.num_drafts, seq.sample) == (
        (10, 11, 12, 13, 14, 15), 3, 5, True)
    assert seq.block_table == (1, 2, 3)                     # positions 0 .. 8
    rs = state.requests["a"]
    assert (rs.num_computed_tokens, rs.num_draft_tokens, rs.num_tokens) == (9, 5, 4)
    check_invariants(state, sc)
    state = update(state, plan, [(11, 12, 99)])             # 2 drafts accepted, then 99
    rs = state.requests["a"]
    assert rs.output_token_ids == (10, 11, 12, 99)
    assert (rs.num_computed_tokens, rs.num_draft_tokens) == (6, 0)
    assert state.block_manager.block_table("a") == (1, 2)   # block 3 only held rejected drafts
    assert state.block_manager.free_block_ids()[0] == 3     # back at the head of the queue
    check_invariants(state, sc)
    with pytest.raises(ValueError, match="takes 1 to 1 \\+ num_drafts = 1"):
        update(*schedule(state, sc), [(1, 2)])


def decoding(cc, sc, prompt=(1, 2, 3), max_tokens=8):
    """A state where request "a" has computed its prompt and decodes its token 10 next."""
    state = add_request(init_state(cc), req("a", prompt, max_tokens=max_tokens), sc)
    state, plan = schedule(state, sc)
    return update(state, plan, [10])


def test_drafts_take_only_what_the_step_leaves():
    # the budget: 1 + 3 tokens
    cc, sc = configs(budget=4, prefix_caching=None)
    state, plan = schedule(decoding(cc, sc), sc, {"a": (1, 2, 3, 4, 5)})
    assert plan.seqs[0].num_drafts == 3 and plan.num_tokens == 4
    # a prefill chunk admitted in the same step goes first; drafts of a non-decode are ignored
    state = add_request(decoding(cc, sc), req("b", (5, 6, 7)), sc)
    state, plan = schedule(state, sc, {"a": (1, 2, 3), "b": (4,)})
    assert [(s.request_id, s.num_drafts) for s in plan.seqs] == [("a", 0), ("b", 0)]
    # the free blocks: drafts never preempt; with no block free they fill a's last block
    cc, sc = configs(num_blocks=3, block_size=4, budget=16, prefix_caching=None)
    state = add_request(decoding(cc, sc, prompt=(1, 2), max_tokens=6),
                        req("b", (5, 6, 7, 8), max_tokens=1), sc)
    state, plan = schedule(state, sc, {"a": (1, 2, 3, 4)})
    assert [(s.request_id, s.num_drafts) for s in plan.seqs] == [("a", 1), ("b", 0)]
    assert not plan.preempted_ids and state.block_manager.num_free_blocks == 0
    # max_tokens: a fully accepted run (drafts + bonus token) ends at max_tokens = 4
    cc, sc = configs(budget=32, prefix_caching=None)
    state, plan = schedule(decoding(cc, sc, max_tokens=4), sc, {"a": (1, 2, 3, 4, 5)})
    assert plan.seqs[0].num_drafts == 2


@pytest.mark.parametrize("tokens, stop, want, reason", [
    ((5, 7, 6), dict(eos_token_ids=(7,)), (5, 7), "stop"),                # eos inside the run
    ((5, 7, 6), dict(eos_token_ids=(7,), min_tokens=5), (5, 7, 6), None),  # before min_tokens
    ((5, 7, 6), dict(eos_token_ids=(7,), ignore_eos=True), (5, 7, 6), None),
    ((5, 6, 8), dict(stop_token_ids=(6,)), (5, 6), "stop"),
    ((5, 6, 8), dict(max_tokens=4), (5, 6), "length"),   # 2 + 2 = max_tokens: 1 draft fits
])
def test_stop_rules_on_each_accepted_token(tokens, stop, want, reason):
    cc, sc = configs(prefix_caching="radix")
    state = add_request(init_state(cc), req("a", (1, 2, 3), **{"max_tokens": 12, **stop}), sc)
    for first in (30, 31):
        state, plan = schedule(state, sc)
        state = update(state, plan, [first])
    rs = state.requests["a"]
    assert accepted_tokens(rs, tokens) == want
    state, plan = schedule(state, sc, {"a": tokens[:-1]})
    n = plan.seqs[0].num_drafts
    assert n == min(2, stop.get("max_tokens", 12) - 3)
    state = update(state, plan, [tokens[:n + 1]])
    check_invariants(state, sc)
    if reason is None:
        assert state.requests["a"].output_token_ids == (30, 31) + want
    else:
        assert state.finished["a"].output_token_ids == (30, 31) + want
        assert state.finished["a"].finish_reason == reason
        assert state.block_manager.num_free_blocks == cc.num_blocks - 1


def test_prefix_cache_registers_verified_tokens_only():
    cc, sc = configs(block_size=4, prefix_caching="hash")
    state = decoding(cc, sc)                                     # 1 2 3 10, computed 3
    state, plan = schedule(state, sc, {"a": (11, 12, 13, 14)})   # positions 3 .. 7
    state = update(state, plan, [(50,)])                         # every draft rejected
    bm = state.block_manager
    assert bm.num_registered("a") == 1 and bm.num_cached_blocks == 1   # [1 2 3 10]
    assert len(bm.lookup((1, 2, 3, 10, 11, 12, 13, 14, 0))[0]) == 1    # not the drafts' block
    state, plan = schedule(state, sc, {"a": (51, 52, 60, 61)})   # positions 4 .. 8
    state = update(state, plan, [(51, 52, 60, 70)])              # 3 accepted, then 70
    bm = state.block_manager
    assert state.requests["a"].output_token_ids == (10, 50, 51, 52, 60, 70)
    assert bm.num_registered("a") == 2 and bm.num_cached_blocks == 2   # + [50 51 52 60]
    assert len(bm.lookup((1, 2, 3, 10, 50, 51, 52, 60, 70))[0]) == 2


# ---------------------------------------------------------------- the rejection sampler


def test_num_accepted_equals_a_loop():
    import jax.numpy as jnp

    from jaxkv.sample.rejection import num_accepted

    rng = np.random.default_rng(0)
    targets = rng.integers(0, 3, (64, 5)).astype(np.int32)
    drafts = rng.integers(0, 3, (64, 4)).astype(np.int32)
    n_drafts = rng.integers(0, 5, 64).astype(np.int32)
    want = []
    for t, d, k in zip(targets, drafts, n_drafts):
        n = 1
        while n <= k and d[n - 1] == t[n - 1]:
            n += 1
        want.append(n)
    got = num_accepted(jnp.asarray(targets), jnp.asarray(drafts), jnp.asarray(n_drafts))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(num_accepted(jnp.zeros((3, 1), jnp.int32),
                                               jnp.zeros((3, 0), jnp.int32),
                                               jnp.zeros(3, jnp.int32)), [1, 1, 1])


def leviathan_first_tokens(p, draft, rng, n):
    """Leviathan et al.'s rule, literally, for a point-mass draft q = delta_draft: the first
    emitted token of ``n`` independent verifications (numpy reference)."""
    q = np.eye(len(p))[draft]
    residual = np.maximum(p - q, 0)
    residual /= residual.sum()
    accept = rng.random(n) < np.minimum(1, p[draft] / q[draft])
    return np.where(accept, draft, rng.choice(len(p), n, p=residual))



def test_rejection_sampling_keeps_the_target_distribution():
    """2 rows per verification (after the last token, after the draft), 4000 verifications of a
    fixed distribution (temperature 0.8, top-k 5 over 6 tokens) with a fixed draft: the first
    emitted token ~ p0, acceptance ~ p0(draft), the correction ~ p0 without the draft, the
    bonus token ~ p1, and the same as Leviathan's rule computed literally."""
    import jax
    from scipy import stats

    from jaxkv.sample.rejection import num_accepted
    from jaxkv.sample.sampler import SamplingParams, SamplingTensors, sample

    n, draft = 4000, 2
    logits = np.array([[1.0, 0.2, 0.9, -0.5, 0.4, -3.0],
                       [0.1, 1.5, -0.3, 0.8, -1.0, 0.0]], np.float32)
    params = SamplingParams(temperature=0.8, top_k=5)
    t = SamplingTensors.from_params([params] * 2 * n, vocab_size=6,
                                    prompt_token_ids=[(1,)] * 2 * n,
                                    output_token_ids=[(), (draft,)] * n)
    tokens, _, _ = sample(np.tile(logits, (n, 1)), t, jax.random.key(3))
    tokens = np.asarray(tokens).reshape(n, 2)
    emitted = np.asarray(num_accepted(tokens, np.full((n, 1), draft, np.int32),
                                      np.ones(n, np.int32)))

    def target(row):   # softmax(l / T) over the top 5
        z = np.exp(row / 0.8) * (row >= np.sort(row)[-5])
        return z / z.sum()
    p0, p1 = target(logits[0].astype(np.float64)), target(logits[1].astype(np.float64))

    def chi2_p(samples, p):
        keep = p > 0
        observed = np.bincount(samples, minlength=len(p))
        assert observed[~keep].sum() == 0
        return stats.chisquare(observed[keep], p[keep] / p[keep].sum() * len(samples)).pvalue

    first = tokens[:, 0]
    accepted = emitted == 2
    np.testing.assert_array_equal(accepted, first == draft)
    assert chi2_p(first, p0) > 1e-3
    assert abs(accepted.mean() - p0[draft]) < 4 * np.sqrt(p0[draft] * (1 - p0[draft]) / n)
    assert chi2_p(first[~accepted], np.where(np.arange(6) == draft, 0, p0)) > 1e-3
    assert chi2_p(tokens[accepted, 1], p1) > 1e-3
    reference = leviathan_first_tokens(p0, draft, np.random.default_rng(0), n)
    table = np.stack([np.bincount(first, minlength=6), np.bincount(reference, minlength=6)])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3


# ---------------------------------------------------------------- the n-gram proposer


@pytest.mark.parametrize("tokens, k, n, want", [
    ((1, 2, 3, 4, 5, 1, 2, 3), 2, (1, 4), (4, 5)),
    ((1, 2, 3, 4, 5, 1, 2, 3), 9, (1, 4), (4, 5, 1, 2, 3)),        # up to the end
    ((9, 2, 3, 7, 5, 3, 8, 9, 2, 3), 2, (1, 3), (7, 5)),           # longest before most recent
    ((9, 2, 3, 7, 5, 3, 8, 9, 2, 3), 2, (1, 1), (8, 9)),           # max_n 1: most recent "3"
    ((1, 2, 5, 1, 2, 6, 1, 2), 2, (1, 4), (6, 1)),                 # most recent of equals
    ((1, 2, 5, 3, 2), 2, (2, 4), ()),                              # only a 1-gram matches
    ((4, 4, 4), 3, (1, 4), (4,)),                                  # overlapping match
    ((7,), 3, (1, 4), ()),
    ((1, 2, 3), 3, (1, 4), ()),
])
def test_ngram_proposals(tokens, k, n, want):
    from jaxkv.spec_decode.ngram import NgramProposer

    assert NgramProposer(*n).propose(np.array(tokens, np.int32), k) == want


def test_ngram_equals_a_brute_force_lookup():
    from jaxkv.spec_decode.ngram import NgramProposer

    def brute(a, k, min_n, max_n):
        for n in range(min(max_n, len(a) - 1), min_n - 1, -1):
            hits = [i for i in range(len(a) - n) if a[i:i + n] == a[len(a) - n:]]
            if hits:
                return tuple(a[hits[-1] + n:hits[-1] + n + k])
        return ()

    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(rng.choice([2, 4, 8])) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        assert NgramProposer(min_n, max_n).propose(np.array(a), k) == brute(a, k, min_n, max_n)


# ---------------------------------------------------------------- the engine (tiny model)


@pytest.fixture(scope="module")
def spec_llm(tiny):
    from jaxkv import LLM
    from tiny_models import TINY_ENGINE

    with LLM(str(tiny[0]), **TINY_ENGINE, speculative="ngram", num_speculative_tokens=4,
             speculative_adaptive=False) as llm:
        yield llm


def token_lists(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_ngram_greedy_equals_non_speculative_on_repetitive_prompts(tiny_llm, spec_llm):
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    passages = austen_prompts(4, seed=5, max_chars=160)
    prompts = [f"{p} {p} {p[:len(p) // 2]}" for p in passages]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    steps = tiny_llm.stats()["num_steps"]
    want = token_lists(tiny_llm.generate(prompts, params, use_tqdm=False))
    steps = tiny_llm.stats()["num_steps"] - steps
    before = spec_llm.stats()
    outs = spec_llm.generate(prompts, params, use_tqdm=False)
    after = spec_llm.stats()
    assert token_lists(outs) == want
    # the random tiny model rarely repeats its prompt (SmolLM2 does: bench/speculative.py)
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    verified = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    assert 0 < accepted <= verified
    assert after["num_steps"] - before["num_steps"] <= steps
    assert after["kv_blocks_used"] == 0
    spec_llm.engine.check_invariants()


def run_stepwise(llm, prompts, params, check=None):
    """Adds the prompts (ids "0", "1", ...) and steps the engine to the end, calling
    ``check(scheduler_state)`` after every step; returns the outputs in order."""
    engine = llm.engine
    engine.reset_prefix_cache()
    ids = [engine.add_request(p, params, request_id=f"s{i}") for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        done.update({k: v for k, v in engine.step().items() if v.finished})
        engine.check_invariants()
        if check:
            check(engine.scheduler_state)
    return [done[i] for i in ids]


@pytest.mark.parametrize("params", [
    dict(temperature=0, max_tokens=40, ignore_eos=True),
    pytest.param(dict(temperature=0.9, top_k=50, seed=11, repetition_penalty=1.3, min_tokens=30,
                      max_tokens=40), marks=pytest.mark.slow),
])
def test_random_drafts_keep_outputs_tables_and_prefix_cache(tiny_llm, spec_llm, monkeypatch,
                                                            params):
    """Drafts right or random: greedy and seeded (penalties, min_tokens) outputs equal the
    non-speculative run's, and at every token count each decoding request's counter, table
    length, registered blocks and prefix-cache hits equal that run's."""
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    params = SamplingParams(**params)
    prompts = austen_prompts(5, seed=9, max_chars=40)
    seen = {}

    def record(state):
        for i in decoding_ids(state):
            seen[i, state.requests[i].num_tokens] = snapshot(state, i)

    want = run_stepwise(tiny_llm, prompts, params, record)
    checked = []

    def check(state):
        for i in decoding_ids(state):
            key = (i, state.requests[i].num_tokens)
            assert snapshot(state, i) == seen[key], key
            checked.append(key)

    references = {tuple(o.prompt_token_ids): tuple(o.outputs[0].token_ids) for o in want}
    monkeypatch.setattr(spec_llm.engine.speculator, "proposer", OracleProposer(references, 0.3))
    before = spec_llm.stats()
    got = run_stepwise(spec_llm, prompts, params, check)
    after = spec_llm.stats()
    assert token_lists(got) == token_lists(want)
    assert [o.outputs[0].cumulative_logprob for o in got] == pytest.approx(
        [o.outputs[0].cumulative_logprob for o in want], abs=1e-3)
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    verified = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    assert 0 < accepted < verified and checked
    a, b = spec_llm.engine.scheduler_state.block_manager, \
        tiny_llm.engine.scheduler_state.block_manager
    assert a.num_free_blocks == b.num_free_blocks and a.num_cached_blocks == b.num_cached_blocks
    for o in want:
        full = tuple(o.prompt_token_ids) + tuple(o.outputs[0].token_ids)
        assert len(a.lookup(full)[0]) == len(b.lookup(full)[0])


def test_stops_inside_an_accepted_run(tiny_llm, spec_llm, monkeypatch):
    """Perfect drafts: a stop token, a stop string and max_tokens landing inside a run of
    accepted drafts end the output exactly where non-speculative decoding ends it."""
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    prompts = austen_prompts(3, seed=13, max_chars=60)
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = tiny_llm.generate(prompts, base, use_tqdm=False)
    references = {tuple(o.prompt_token_ids): tuple(o.outputs[0].token_ids) for o in full}
    monkeypatch.setattr(spec_llm.engine.speculator, "proposer", OracleProposer(references, 0.0))
    text = full[0].outputs[0].text
    cases = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                       stop_token_ids=[full[0].outputs[0].token_ids[9]]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                       stop=[text[len(text) // 2:len(text) // 2 + 3]]),
        SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
    ]
    for params in cases:
        want = tiny_llm.generate(prompts, params, use_tqdm=False)
        got = spec_llm.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.outputs[0].text == w.outputs[0].text
            assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (
                w.outputs[0].finish_reason, w.outputs[0].stop_reason)
    assert spec_llm.stats()["kv_blocks_used"] == 0
    spec_llm.engine.check_invariants()


def test_stats_and_cli_flags(spec_llm):
    import argparse

    from jaxkv.config import EngineConfig

    s = spec_llm.stats()
    assert s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"] <= (
        s["spec_num_proposed_tokens"])
    assert s["spec_acceptance_rate"] == pytest.approx(
        s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"])
    assert s["spec_mean_acceptance_length"] == pytest.approx(
        1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"])
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli(parser.parse_args(
        ["--speculative", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "2"]))
    assert (config.speculative.speculative, config.speculative.max_drafts,
            config.speculative.prompt_lookup_min) == ("ngram", 3, 2)
    assert EngineConfig.from_cli(parser.parse_args([])).speculative.max_drafts == 0
    with pytest.raises(ValueError, match="prompt_lookup_min=5 must be <= prompt_lookup_max=4"):
        EngineConfig.from_kwargs(speculative="ngram", prompt_lookup_min=5)


# ---------------------------------------------------------------- adaptive draft length


def test_best_num_drafts():
    from jaxkv.spec_decode.draft_lengths import best_num_drafts

    assert best_num_drafts(1.0, 8, 0.1) == 8
    assert best_num_drafts(0.0, 8, 0.1) == 0
    assert best_num_drafts(0.1, 8, 0.1) == 0            # a <= c: one draft does not pay
    assert best_num_drafts(0.11, 8, 0.1) >= 1
    assert best_num_drafts(0.9, 8, 0.0) == 8
    ks = [best_num_drafts(a / 20, 8, 0.1) for a in range(21)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8
    # the chosen k maximises E(k) / (1 + c k)
    for a in (0.3, 0.6, 0.8):
        value = [sum(a ** i for i in range(k + 1)) / (1 + 0.1 * k) for k in range(9)]
        assert best_num_drafts(a, 8, 0.1) == int(np.argmax(value))


def step_one_request(spec, state, sc, steps, before=None, seconds=None, arrivals=None
                     ) -> list[int]:
    """``steps`` steps of the oracle scheduler with ``spec``'s drafts, every step's tokens
    recorded (``seconds(plan)``: its synthetic device time, else untimed); ``before(step)``
    runs before each schedule, and ``arrivals[step]`` (a ``Request``) is added then. Returns
    the drafts the first scheduled sequence verified per step (0 in an empty step)."""
    lengths = []
    for step in range(steps):
        if before is not None:
            before(step)
        if arrivals and step in arrivals:
            state = add_request(state, arrivals[step], sc)
        state, plan = schedule(state, sc, spec.drafts(state))
        tokens = verify(state, plan)
        rows = [t if isinstance(t, list) else [t] for t in tokens] or [[0]]
        width = max(map(len, rows))
        spec.record(plan, np.array([r + [0] * (width - len(r)) for r in rows]),
                    np.array([len(r) for r in rows]), None if seconds is None else seconds(plan))
        state = update(state, plan, tokens)
        lengths.append(plan.seqs[0].num_drafts if plan.seqs else 0)
    return lengths


def test_adaptive_length_stops_drafting_wrong_proposals_and_resumes():
    """A proposer that is wrong for a while: the request stops getting drafts (its proposals
    are still compared with what it emits), then drafts again once they match."""
    from jaxkv.spec_decode.speculator import Speculator

    proposer = SwitchingProposer(right=False)
    spec = Speculator(proposer, 4, draft_cost=0.1)
    cc, sc = configs(max_model_len=256)
    state = add_request(init_state(cc), req("a", (1, 2, 3), max_tokens=200), sc)

    def switch(step):
        proposer.right = step >= 20

    lengths = step_one_request(spec, state, sc, 35, switch)
    assert lengths[1] > 0 and lengths[10:20] == [0] * 10     # stopped after a few misses
    assert spec.acceptance("a") > 0.5 and lengths[-1] == 4   # back to the full length
    assert spec.stats()["spec_num_accepted_tokens"] > 0


class ProbedProposer(SwitchingProposer):
    """A ``SwitchingProposer`` whose proposals cost a forward (as a draft model's): asked for a
    k = 0 request once per ``probe_interval`` steps; records the steps it was asked at."""

    probe_interval = 2

    def __init__(self, right: bool):
        super().__init__(right)
        self.asked_at: list[int] = []
        self.step = 0

    def propose(self, token_ids, num_drafts):
        self.asked_at.append(self.step)
        return super().propose(token_ids, num_drafts)


def test_probes_back_off_until_the_request_drafts():
    """A draft at c = 0.3 that is wrong for 130 steps, then right: the request drafts on its
    first steps (the prior 1/2 > c), stops at the first misses, and is probed 2, 4, 8, 16, 32,
    32, ... steps apart (the interval doubles after every probe that leaves it at k = 0, up to
    16 base intervals); once the proposals match, the interval stays (a matching probe that
    does not lift the estimate above c is no reason to probe more often) until the second
    matching probe makes it draft, then it drafts every step."""
    from jaxkv.spec_decode.speculator import Speculator

    proposer = ProbedProposer(right=False)
    spec = Speculator(proposer, 4, draft_cost=0.3)
    cc, sc = configs(num_blocks=128, max_model_len=512)
    state = add_request(init_state(cc), req("a", (1, 2, 3), max_tokens=400), sc)

    def switch(step):
        proposer.step, proposer.right = step, step >= 130

    lengths = step_one_request(spec, state, sc, 200, switch)
    asked = proposer.asked_at
    wrong = [t for t in asked if t < 130]
    assert wrong[:2] == [1, 2] and lengths[1] > 0 and lengths[2] > 0
    assert np.diff(wrong[1:]).tolist() == [2, 4, 8, 16, 32, 32, 32]
    assert lengths[3:130] == [0] * 127
    right = [t for t in asked if t >= 130]
    assert np.diff(right[:3]).tolist() == [32, 1]   # two probes, then every step
    assert lengths[right[1] + 1] > 0 and lengths[-1] == 4 and spec.acceptance("a") > 0.9


def test_new_requests_start_from_what_the_engine_learned():
    """After a request whose draft never matched (c = 0.3), a new one starts at the pooled
    acceptance (near 0, not the prior 1/2: it does not draft on its first step) and at the
    probe interval the first one reached (32 steps, not 2). On a fresh engine the same request
    drafts at once."""
    from jaxkv.spec_decode.speculator import Speculator

    cc, sc = configs(num_blocks=128, max_model_len=512)
    proposer = ProbedProposer(right=False)
    spec = Speculator(proposer, 4, draft_cost=0.3)
    first = add_request(init_state(cc), req("a", (1, 2, 3), max_tokens=120), sc)
    step_one_request(spec, first, sc, 121, lambda step: setattr(proposer, "step", step))
    assert proposer.asked_at[-2:] == [64, 96]   # "a" finishes in step 120, probed last at 96
    assert spec.acceptance("b") < 0.1
    proposer.asked_at = []
    second = add_request(init_state(cc), req("b", (4, 5, 6), max_tokens=100), sc)
    lengths = step_one_request(spec, second, sc, 60, lambda step: setattr(proposer, "step", step))
    # the prefill is step 0; at step 7 no request has been asked for 32 steps (96 .. 120, 1 ..
    # 7): the engine's own probe; then "b"'s interval is 32
    assert lengths == [0] * 60 and proposer.asked_at == [7, 39]

    fresh = Speculator(ProbedProposer(right=False), 4, draft_cost=0.3)
    second = add_request(init_state(cc), req("b", (4, 5, 6), max_tokens=100), sc)
    assert step_one_request(fresh, second, sc, 2)[1] > 0


def test_engine_probes_requests_shorter_than_the_interval():
    """Requests of 12 tokens arriving every 8 steps, proposals wrong until step 200: once the
    interval has grown past a request's life (32 steps) no request is probed on its own, so
    the engine probes the longest unasked one every 32 quiet steps; after the proposals turn
    right, the first such probe makes its request draft, and new requests are asked from their
    first decode again (and draft)."""
    from jaxkv.spec_decode.speculator import Speculator

    cc, sc = configs(num_blocks=256, max_model_len=512)
    proposer = ProbedProposer(right=False)
    spec = Speculator(proposer, 4, draft_cost=0.3)
    arrivals = {8 * n: req(f"r{n}", (1 + n % 5, 2, 3), max_tokens=12) for n in range(40)}

    def switch(step):
        proposer.step, proposer.right = step, step >= 200

    step_one_request(spec, init_state(cc), sc, 320, switch, arrivals=arrivals)
    asked = np.array(proposer.asked_at)
    quiet = asked[(asked > 100) & (asked < 200)]
    assert len(quiet) >= 2 and set(np.diff(quiet).tolist()) == {32}
    resumed = asked[asked >= 200]
    assert resumed[0] - quiet[-1] == 32
    later = [t + 1 for t in arrivals if t > resumed[0]]   # each one's first decode step
    assert later and set(later) <= set(asked.tolist())
    lengths = step_one_request(spec, init_state(cc), sc, 2, arrivals={0: req("x", (1, 2, 3))})
    assert lengths[1] > 0 and spec.stats()["spec_num_accepted_tokens"] > 50


class CostlyProposer(ProbedProposer):
    """A ``ProbedProposer`` batched as the draft model is: one draft forward per draft position
    over the requests still drafting, reported into its ``forward_cost`` at that many rows and
    taking ``forward_seconds`` per proposed token (as the draft model measures its forwards)."""

    def __init__(self, right: bool, forward_seconds: float, sc):
        from jaxkv.sched.step_cost import StepCostModel

        super().__init__(right)
        self.forward_cost = StepCostModel.for_scheduler(sc)
        self.forward_seconds = forward_seconds

    def propose_batch(self, requests):
        for position in range(max((k for _, k in requests.values()), default=0)):
            rows = sum(k > position for _, k in requests.values())
            self.forward_cost.observe(rows, rows, False, rows * self.forward_seconds)
        return {i: self.propose(tokens, k) for i, (tokens, k) in requests.items()}


def step_time_speculator(proposer, sc):
    """An adaptive speculator (at most 4 drafts) of ``proposer`` with a step-time model over
    the scheduler config ``sc``'s buckets: as ``Speculator.from_args`` builds an engine's."""
    from jaxkv.sched.step_cost import StepCostModel
    from jaxkv.spec_decode.speculator import Speculator

    return Speculator(proposer, 4, draft_cost=0.1,
                      step_cost=StepCostModel.for_scheduler(sc),
                      max_num_batched_tokens=sc.max_num_batched_tokens)


def test_probes_cost_at_most_their_share_of_the_step_time():
    """As above, with step times: wrong drafts whose forward takes 50 ms against 100 ms target
    steps. The probes, the requests' own and the engine's, are held to 5% of the measured
    step time (plus one probe), where 12-token requests probed every 2 steps would spend 25%;
    they do go on (the engine notices when the drafts turn right)."""

    cc, sc = configs(num_blocks=256, max_model_len=512)
    proposer = CostlyProposer(False, 0.05, sc)
    spec = step_time_speculator(proposer, sc)
    arrivals = {8 * n: req(f"r{n}", (1 + n % 5, 2, 3), max_tokens=12) for n in range(60)}
    lengths = step_one_request(spec, init_state(cc), sc, 480,
                               lambda step: setattr(proposer, "step", step),
                               lambda plan: 0.1, arrivals)
    probes = [t for t in proposer.asked_at if t > 20]   # after the exploration of the start
    assert sum(lengths[20:]) == 0 and len(probes) >= 10
    assert len(probes) * 0.05 <= 0.05 * 0.1 * 480 + 0.05


@pytest.mark.parametrize("forward_seconds, drafts", [(0.05, True), (1.5, False)])
def test_step_time_rule_weighs_the_measured_draft_forward(forward_seconds, drafts):
    """Always-right drafts on a target whose plain step takes 1 s: the first steps are plain
    (measuring the plain step: each shape's first time holds its compilation), the next drafts (the
    draft's forward is unmeasured, so free: the draft step is explored); then a draft whose
    forward takes 5% of a step drafts the full length (5 tokens in 1.04 + 4 x 0.05 s), and
    one costlier than the target (2 tokens in 1.01 + 1.5 s at best) never verifies a draft
    again, nor is it probed."""

    cc, sc = configs(num_blocks=128, max_model_len=512)
    proposer = CostlyProposer(True, forward_seconds, sc)
    spec = step_time_speculator(proposer, sc)
    state = add_request(init_state(cc), req("a", (1, 2, 3), max_tokens=400), sc)
    costs = []

    def note(step):
        proposer.step = step
        costs.append(spec.proposal_time(1, 4))

    lengths = step_one_request(spec, state, sc, 40, note,
                               lambda plan: 1.0 + 0.01 * plan.num_drafts)
    # the prefill (3 tokens) and the first decode (1 row, decode bucket 1) run on two shapes,
    # each first time dropped, so the plain step is measured from step 2 on and drafts from 3
    assert lengths[:3] == [0, 0, 0] and proposer.asked_at[0] == 3
    assert costs[3] == 0.0 and lengths[3] > 0   # the forward unmeasured: free
    assert costs[-1] == pytest.approx(4 * forward_seconds)
    if drafts:
        assert lengths[3:] == [4] * 37 and spec.stats()["spec_num_accepted_tokens"] > 0
    else:
        assert lengths == [0, 0, 0, 4] + [0] * 36
        # once its forward is measured slower than the target's step, no draft could pay,
        # were every one accepted: it is not even probed
        assert proposer.asked_at == [3]


@pytest.mark.parametrize("forward_seconds, backs_off", [(0.05, False), (0.3, True)])
def test_probes_back_off_only_over_their_budget(forward_seconds, backs_off):
    """Wrong drafts on a target whose plain step takes 1 s, probed once per 2 steps: a probe
    whose forward takes 0.05 s costs 2.5% of the step time and keeps that interval; one of 0.3
    s (15%, over the 5% share) backs off as under the fixed-cost rule."""

    cc, sc = configs(num_blocks=128, max_model_len=512)
    proposer = CostlyProposer(False, forward_seconds, sc)
    spec = step_time_speculator(proposer, sc)
    state = add_request(init_state(cc), req("a", (1, 2, 3), max_tokens=400), sc)
    lengths = step_one_request(spec, state, sc, 60, lambda step: setattr(proposer, "step", step),
                               lambda plan: 1.0 + 0.01 * plan.num_drafts)
    assert sum(lengths[10:]) == 0
    gaps = np.diff([t for t in proposer.asked_at if t >= 10]).tolist()
    if backs_off:
        assert max(gaps) >= 16
    else:
        assert gaps == [2] * len(gaps) and len(gaps) >= 20


def test_adaptive_engine_drafts_less_when_drafts_fail(tiny_llm, spec_llm, monkeypatch):
    """On the random tiny model n-gram drafts are almost never right: adaptive k verifies a
    fraction of the drafts fixed k does, with the same outputs."""
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    prompts = austen_prompts(4, seed=21, max_chars=80)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = token_lists(tiny_llm.generate(prompts, params, use_tqdm=False))
    verified = []
    for cost in (None, 0.1):
        monkeypatch.setattr(spec_llm.engine.speculator, "draft_cost", cost)
        before = spec_llm.stats()["spec_num_draft_tokens"]
        assert token_lists(spec_llm.generate(prompts, params, use_tqdm=False)) == want
        verified.append(spec_llm.stats()["spec_num_draft_tokens"] - before)
    assert verified[1] < verified[0] / 3


def test_pallas_kernel_verify_steps_equal_reference(tiny, tiny_llm):
    """The Pallas ragged kernel (interpret mode) on decodes of 1 + k query tokens: the same
    greedy tokens as the reference attention without speculation."""
    from jaxkv import LLM
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import TINY_ENGINE, austen_prompts

    prompts = austen_prompts(2, seed=9, max_chars=40)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = tiny_llm.generate(prompts, params, use_tqdm=False)
    references = {tuple(o.prompt_token_ids): tuple(o.outputs[0].token_ids) for o in want}
    with LLM(str(tiny[0]), **TINY_ENGINE, attention_impl="pallas", interpret=True,
             speculative="ngram", num_speculative_tokens=4, speculative_adaptive=False) as llm:
        llm.engine.speculator.proposer = OracleProposer(references, 0.3)
        assert token_lists(llm.generate(prompts, params, use_tqdm=False)) == token_lists(want)
        assert llm.stats()["spec_num_accepted_tokens"] > 0


# ---------------------------------------------------------------- the step-time model


def test_step_cost_model_fits_synthetic_timings():
    """Durations keyed by padded shape: the first of each shape (its compilation) is dropped,
    then a moving average; a shape goes stale after ``refresh`` observations and is asked for
    again; a shape asked for but not reached is not asked for again at once."""
    from jaxkv.sched.step_cost import StepCostModel

    model = StepCostModel((16, 64, 256), (8, 32), refresh=10)
    assert model.key(17, 3, True) == (64, 8, True) and model.key(300, 40, False) == (256, 32, False)
    assert model.predict(10, 4, False) is None and model.wants(10, 4, False)
    assert model.observe(10, 4, False, 5.0) is False   # compile: dropped
    assert model.predict(12, 2, False) is None and model.wants(12, 2, False)
    rng = np.random.default_rng(0)
    times = 0.010 + 0.001 * rng.standard_normal(40)
    assert [model.observe(16, 8, False, t) for t in times] == [True] * 40
    assert model.predict(1, 1, False) == pytest.approx(0.010, abs=0.002)
    assert model.predict(1, 1, True) is None and model.predict(17, 1, False) is None
    ema = times[0]
    for t in times[1:]:
        ema = 0.7 * ema + 0.3 * t
    assert model.predict(16, 8, False) == pytest.approx(ema, rel=1e-12)
    assert not model.wants(16, 8, False)
    model.tried(64, 8, True)                         # planned, but the step stayed at 16
    model.observe(16, 8, False, 0.01)
    assert not model.wants(64, 8, True)
    for _ in range(11):
        model.observe(256, 32, False, 0.1)
    assert model.wants(16, 8, False) and model.wants(64, 8, True)   # stale / retry
    assert model.predict(16, 8, False) is not None
    model.compiled()   # every shape compiled by a warm-up: a first duration is a step's
    assert model.observe(64, 32, True, 0.05) is True
    assert model.predict(64, 32, True) == 0.05 and not model.wants(64, 32, True)


def _brute_force_drafts(acceptance, caps, base, budget, buckets, table, proposing):
    """max over every k vector of sum E_i(k_i) / (step time (padded-bucket table) + proposal
    time ``proposing[max k]`` of a drafting step)."""
    import itertools

    best = 0.0
    for ks in itertools.product(*(range(c + 1) for c in caps)):
        total = base + sum(ks)
        if total > budget:
            continue
        bucket = next(b for b in buckets if b >= total)
        expected = sum(sum(a ** j for j in range(k + 1)) for a, k in zip(acceptance, ks))
        best = max(best, expected / (table[bucket, sum(ks) > 0] + proposing[max(ks)]))
    return best


def random_proposal_times(rng, costly: bool) -> np.ndarray:
    """float [5]: the proposal time of a step whose longest draft is 0..4 (0 when not
    ``costly``), rising with it."""
    per_draft = rng.uniform(0.0, 0.5) if costly else 0.0
    return np.concatenate([[0.0], np.cumsum(per_draft * rng.uniform(0.5, 1.5, 4))])


BUCKETS = (4, 8, 12, 16)


def random_allocations(seed: int, cases: int = 300):
    """Random draft-allocation problems over ``BUCKETS``: (case, acceptance [n], caps [n],
    base tokens, budget, plain step time per bucket rising with the bucket, rng)."""
    rng = np.random.default_rng(seed)
    for case in range(cases):
        n = int(rng.integers(1, 4))
        acceptance = rng.uniform(0, 1, n).round(2)
        caps = rng.integers(0, 5, n)
        base = n + int(rng.integers(0, 4))
        budget = int(rng.choice((12, 16)))
        yield (case, acceptance, caps, base, budget,
               np.cumsum(rng.uniform(0.05, 1.0, len(BUCKETS))), rng)


@pytest.mark.parametrize("costly", [False, True])
def test_allocate_drafts_equals_brute_force(costly):
    """Free proposals, and costly ones (a draft model's: ``proposal_time`` of the longest
    draft): the exact optimum of every case."""
    from jaxkv.spec_decode.draft_lengths import allocate_drafts

    buckets = BUCKETS
    for case, acceptance, caps, base, budget, cost, rng in random_allocations(1 + costly):
        table = {(b, d): cost[i] * (1 + d * rng.uniform(0, 0.3))
                 for i, b in enumerate(buckets) for d in (False, True)}
        step_time = lambda t, d: table[next(b for b in buckets if b >= t), d]
        proposing = random_proposal_times(rng, costly)
        ks = allocate_drafts(acceptance, caps, base, budget, buckets, step_time,
                             (lambda m: proposing[m]) if costly else None)
        assert all(0 <= k <= c for k, c in zip(ks, caps)) and base + sum(ks) <= budget
        expected = sum(sum(a ** j for j in range(k + 1)) for a, k in zip(acceptance, ks))
        value = expected / (step_time(base + sum(ks), sum(ks) > 0) + proposing[max(ks)])
        assert value == pytest.approx(_brute_force_drafts(
            acceptance, caps, base, budget, buckets, table, proposing), rel=1e-12), case


def test_allocate_drafts_bucket_jump_and_unmeasured_shapes():
    """Drafts are free inside the bucket the step pads to and cost the jump beyond it; an
    unmeasured shape is never chosen; no time for the plain step: None."""
    from jaxkv.spec_decode.draft_lengths import allocate_drafts

    buckets = (16, 64)
    flat = lambda t, d: 1.0 if t <= 16 else 4.0   # next bucket 4x
    # 12 decodes fill 12 of 16: 4 drafts fit, the best ones (highest acceptance first)
    acc = [0.9, 0.2] + [0.5] * 10
    ks = allocate_drafts(acc, [4] * 12, 12, 64, buckets, flat)
    assert sum(ks) == 4 and ks[0] == 4
    # sure drafts at a 4x jump: 16 tokens per unit inside the bucket beat 60 / 4
    assert sum(allocate_drafts([1.0] * 12, [4] * 12, 12, 64, buckets, flat)) == 4
    # ... at a 2x jump all 48 drafts pay (60 / 2 > 16); 16 decodes at acceptance 0.3 do not
    # jump (16 x 1.43 / 2 < 16), at 0.6 they do, as many as the 64-token budget leaves
    jump2 = lambda t, d: 1.0 if t <= 16 else 2.0
    assert sum(allocate_drafts([1.0] * 12, [4] * 12, 12, 64, buckets, jump2)) == 48
    assert sum(allocate_drafts([0.3] * 16, [4] * 16, 16, 64, buckets, jump2)) == 0
    assert allocate_drafts([0.6] * 16, [4] * 16, 16, 64, buckets, jump2) == [3] * 16
    unmeasured = lambda t, d: 1.0 if not d else None
    assert allocate_drafts([1.0] * 4, [4] * 4, 4, 64, buckets, unmeasured) == [0] * 4
    assert allocate_drafts([1.0], [4], 1, 64, buckets, lambda t, d: None) is None


def _brute_force_closed(acceptance, caps, remaining, base, budget, buckets, table, proposing):
    """min over every k vector of T(step) + proposing[max k] + T_plain * max_i(remaining_i -
    E_i(k_i))."""
    import itertools

    plain = table[next(b for b in buckets if b >= base), False]
    best = plain * max(remaining)
    for ks in itertools.product(*(range(c + 1) for c in caps)):
        total = base + sum(ks)
        if total > budget or not sum(ks):
            continue
        left = max(r - sum(a ** j for j in range(k + 1))
                   for a, k, r in zip(acceptance, ks, remaining))
        best = min(best, table[next(b for b in buckets if b >= total), True]
                   + proposing[max(ks)] + plain * left)
    return best


@pytest.mark.parametrize("costly", [False, True])
def test_allocate_drafts_closed_equals_brute_force(costly):
    from jaxkv.spec_decode.draft_lengths import allocate_drafts_closed

    buckets = BUCKETS
    for case, acceptance, caps, base, budget, cost, rng in random_allocations(3 + costly):
        remaining = rng.integers(1, 12, len(caps))
        drafts = np.maximum.accumulate(cost * (1 + rng.uniform(0, 0.5, len(buckets))))
        table = {(b, d): (drafts if d else cost)[i]            # with drafts too
                 for i, b in enumerate(buckets) for d in (False, True)}
        step_time = lambda t, d: table[next(b for b in buckets if b >= t), d]
        proposing = random_proposal_times(rng, costly)
        ks = allocate_drafts_closed(acceptance, caps, remaining, base, budget, buckets,
                                    step_time, (lambda m: proposing[m]) if costly else None)
        assert all(0 <= k <= c for k, c in zip(ks, caps)) and base + sum(ks) <= budget
        plain = step_time(base, False)
        got = (step_time(base + sum(ks), True) + proposing[max(ks)] if sum(ks) else 0.0) + (
            plain * max(r - sum(a ** j for j in range(k + 1)) if sum(ks) else r
                        for a, k, r in zip(acceptance, ks, remaining)))
        want = _brute_force_closed(acceptance, caps, remaining, base, budget, buckets, table,
                                   proposing)
        assert got == pytest.approx(want, rel=1e-12), case


def test_closed_batch_drafts_only_when_the_slowest_request_gains():
    """Batch 4's lockstep in miniature: 4 decodes of 60 tokens left, a draft step (bucket 16)
    costs 1.4x the plain one (bucket 8). Three requests' proposals match (acceptance 0.9), one
    never does: the tokens-per-second rule drafts for the three (4 + 3 x 3.4 tokens per 1.4
    beats 4 per 1), the closed-batch rule does not (the fourth sets the end, and gains 0
    tokens); when all four match, both draft; a request far shorter than the others does not
    count (only the longest sets the end)."""
    from jaxkv.spec_decode.draft_lengths import allocate_drafts, allocate_drafts_closed

    buckets = (8, 16)
    step = lambda t, d: 1.0 if t <= 8 else 1.4
    mixed, caps, left = [0.9, 0.9, 0.9, 0.0], [4] * 4, [60] * 4
    assert sum(allocate_drafts(mixed, caps, 4, 16, buckets, step)) > 0
    assert allocate_drafts_closed(mixed, caps, left, 4, 16, buckets, step) == [0] * 4
    assert allocate_drafts_closed([0.9] * 4, caps, left, 4, 16, buckets, step) == [3] * 4
    # the non-matching request has 3 tokens left, the others 60: it does not set the end
    assert sum(allocate_drafts_closed(mixed, caps, [60, 60, 60, 3], 4, 16, buckets, step)) > 0


def drive_step_time(sc, seconds, *, num_requests=4, right=True, steps=40, max_tokens=200,
                    spec=None):
    """The step-time speculator (4 drafts at most) on the oracle scheduler, ``seconds(bucket,
    has_drafts)`` the synthetic device time of a step padded to ``bucket`` tokens, until every
    request finished or ``steps`` steps. Returns ``[(num_tokens, num_drafts, seconds)]`` per
    step and the speculator."""

    cc, _ = configs(num_blocks=16 * num_requests + 64, max_model_len=256)
    spec = spec or step_time_speculator(SwitchingProposer(right), sc)
    state = init_state(cc)
    for i in range(num_requests):
        state = add_request(state, req(f"r{i}", (1, 2, 3 + i), max_tokens=max_tokens), sc)
    steps_done = []
    while state.requests and len(steps_done) < steps:
        state, plan = schedule(state, sc, spec.drafts(state))
        tokens = verify(state, plan)
        rows = [t if isinstance(t, list) else [t] for t in tokens]
        width = max(map(len, rows))
        bucket = next(b for b in sc.token_buckets if b >= plan.num_tokens)
        step_s = seconds(bucket, plan.num_drafts > 0)
        spec.record(plan, np.array([r + [0] * (width - len(r)) for r in rows]),
                    np.array([len(r) for r in rows]), step_s)
        state = update(state, plan, tokens)
        steps_done.append((plan.num_tokens, plan.num_drafts, step_s))
    return steps_done, spec


def test_speculator_measures_shapes_then_maximises_tokens_per_second():
    """The speculator on the oracle scheduler with a synthetic step time: it first measures
    the plain step, then the draft buckets at most one above the plain step's (each twice: the
    first holds the compilation), then drafts only when the drafts' step pays: with drafts as
    cheap as the plain step it fills the best bucket; with a draft step 3x the plain one, the
    first exploration's charge stops exploring (the next bucket is never tried) and, right or
    wrong proposals, it never drafts again."""
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
                         token_buckets=(8, 16, 32), seq_buckets=(8,))

    def drive(draft_factor, right):
        cost = lambda bucket, drafts: (0.004 + bucket * 0.001) * (draft_factor if drafts else 1)
        return [(t, d) for t, d, _ in drive_step_time(sc, cost, right=right, steps=32)[0]]

    # the prefill, the plain step twice, then buckets 8 (the plain step's) and 16 (one up)
    # twice each; 32 (two up) never
    explored = [(12, 0), (4, 0), (4, 0), (8, 4), (8, 4), (16, 12), (16, 12)]
    cheap = drive(1.0, True)
    assert cheap[:7] == explored
    # right drafts: tokens per second 4 / 12 ms plain, 8 / 12, 16 / 20 (best of the measured)
    assert cheap[7:] == [(16, 12)] * 25
    # draft steps at 3x: bucket 8's exploration is charged 24 ms over 48 ms measured (> 5%)
    assert drive(3.0, True)[5:] == drive(3.0, False)[5:] == [(4, 0)] * 27


class CostlyBatchProposer:
    """A ``BatchProposer`` of the oracle's tokens for the requests in ``right`` (else a token
    outside the vocabulary) whose proposals cost ``forward_seconds`` a draft position, recorded
    in its ``forward_cost`` as a draft model's forwards are (one per position over all the
    requests asked); counts the draft forwards."""

    probe_interval = 8

    def __init__(self, right: set, forward_seconds: float, sc):
        from jaxkv.sched.step_cost import StepCostModel

        self.right, self.forward_seconds = right, forward_seconds
        self.forward_cost = StepCostModel.for_scheduler(sc)
        self.num_forwards = 0

    def propose_batch(self, requests):
        out = {}
        for request_id, (token_ids, k) in requests.items():
            history = list(token_ids)
            out[request_id] = []
            for _ in range(k):
                out[request_id].append(oracle(history + out[request_id])
                                       if request_id in self.right else VOCAB + 1)
        for _ in range(max((k for _, k in requests.values()), default=0)):
            self.forward_cost.observe(len(requests), len(requests), False, self.forward_seconds)
            self.num_forwards += 1
        return out

    def release(self, request_id):
        pass


@pytest.mark.parametrize("right", [{"r0", "r1", "r2"}, {"r0", "r1", "r2", "r3"}])
def test_costly_proposer_in_a_lockstep_batch(right):
    """Issue 15's batch-4 draft-model cell in miniature: four requests of 60 tokens decode in
    lockstep (a 4-token plain step, 1 s), a step with drafts pads to 8 or 16 tokens (1 or 1.4
    s), and each draft position costs a 0.1 s forward. With one request's drafts always wrong,
    the fixed-cost rule (c = 0.1 + 0.1 per draft) keeps drafting for the other three, which
    finish early while the fourth sets the batch's end: 19% more time than no speculation.
    The step-time rule stops drafting once that request's misses are measured (it gains
    nothing), losing only its bounded exploration and probes (at most 5% of the step time
    each). With all four right both draft, the
    step-time rule for less (3 drafts each fill 16 tokens: 1.4 + 0.3 s for 4 tokens each)."""
    from jaxkv.spec_decode.speculator import Speculator

    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256,
                         token_buckets=(8, 16, 32), seq_buckets=(8,))
    cost = lambda bucket, has_drafts: {8: 1.0, 16: 1.4, 32: 2.2}[bucket]

    def run(speculator):
        """(steps, total seconds: the target's steps and the draft forwards)."""
        steps, spec = drive_step_time(sc, cost, max_tokens=60, steps=100, spec=speculator)
        forwards = spec.proposer.num_forwards if spec.proposer is not None else 0
        return steps, sum(s for _, _, s in steps) + 0.1 * forwards

    steps, adaptive = run(step_time_speculator(CostlyBatchProposer(right, 0.1, sc), sc))
    _, fixed = run(Speculator(CostlyBatchProposer(right, 0.1, sc), 4, draft_cost=0.2))
    _, plain = run(Speculator(None, 4))
    assert adaptive < fixed
    if len(right) == 3:
        assert fixed > 1.15 * plain and adaptive < 1.1 * plain
        assert [d for _, d, _ in steps[15:]] == [0] * (len(steps) - 15)
    else:
        # once measured, the 16-token draft step (3 drafts each) is the rule's choice
        assert adaptive < 0.55 * plain and steps[-8:-1] == [(16, 12, 1.4)] * 7


BATCH64 = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=256,
                          token_buckets=(16, 64, 256, 1024), seq_buckets=(64,))


@pytest.mark.parametrize("right", [True, False])
def test_cold_batch_of_64_never_pays_for_a_4x_step(right):
    """Issue 15's batch-64 cell in miniature: 64 new requests decode (a 64-token plain step),
    a step with drafts pads to 256 tokens and costs 4.4x, to 1024 tokens 16x. Even sure drafts
    (4 tokens per 256-token step: 58 per unit of time against 64) do not pay, so the best is no
    speculation: the adaptive run may lose at most its bounded exploration, the 256 bucket's
    two visits (the first compiles), against a run that never drafts; it never tries 1024."""
    cost = lambda bucket, drafts: bucket / 64 * (1.1 if drafts else 1.0)
    plain_s = sum(s for _, _, s in drive_step_time(BATCH64, lambda b, d: b / 64,
                                                   num_requests=64, max_tokens=32,
                                                   steps=200, right=False)[0])
    steps, _ = drive_step_time(BATCH64, cost, num_requests=64, max_tokens=32, steps=200,
                               right=right)
    assert max(t for t, _, _ in steps) <= 256 and sum(d > 0 for _, d, _ in steps) <= 2
    assert sum(s for _, _, s in steps) <= plain_s + 2 * (cost(256, True) - cost(64, False))


def test_unmeasured_bucket_two_above_the_plain_step_is_never_tried():
    """A 1024-token draft step as cheap as the plain one would pay, but it is two buckets
    above the plain step's 64: never explored, so never chosen; the 256 bucket (4x) is."""
    cost = {(64, False): 1.0, (256, False): 4.0, (256, True): 4.0, (1024, True): 1.0}
    steps, _ = drive_step_time(BATCH64, lambda b, d: cost[b, d], num_requests=64,
                               max_tokens=32, steps=200)
    assert max(t for t, _, _ in steps[1:]) <= 256
    assert any(d > 0 and t > 64 for t, d, _ in steps)


def test_cold_requests_do_not_choose_the_bucket():
    """Measured shapes where the 256-token draft step costs 1.5x the 64-token plain one: at
    the prior acceptance 1/2, 64 x E(3) = 120 tokens per 1.5 would beat 64 per 1, but cold
    requests do not choose the step's shape (plain); once their proposals are measured right
    (acceptance 0.69 after one matching token: 64 x E(3) = 160 per 1.5), they draft."""
    from jaxkv.sched.step_cost import StepCostModel
    from jaxkv.spec_decode.speculator import Speculator

    model = StepCostModel.for_scheduler(BATCH64)
    for tokens, drafts, seconds in ((64, False, 1.0), (256, True, 1.5), (256, False, 1.4)):
        for _ in range(3):
            model.observe(tokens, 64, drafts, seconds)
    spec = Speculator(SwitchingProposer(True), 4, draft_cost=0.1, step_cost=model,
                      max_num_batched_tokens=1024)
    cost = lambda bucket, drafts: {64: 1.0, 256: 1.5 if drafts else 1.4}[bucket]
    steps, _ = drive_step_time(BATCH64, cost, num_requests=64, max_tokens=32, steps=3,
                               spec=spec)
    prefill, cold, warm = steps
    assert prefill[1] == 0 and cold == (64, 0, 1.0)
    assert warm[0] == 256 and warm[1] == 192


# ---------------------------------------------------------------- the engine's sampled distribution


class TopKDrafter:
    """Random-accept drafts from known contexts: each draft is the context's most likely token
    with probability 1/2, else one of its ``top`` tokens uniformly (so the rejection sampler
    both accepts and rejects); nothing for an unknown context."""

    def __init__(self, top, seed=0):
        self.top = top   # {context tuple: top token ids, most likely first}
        self.rng = np.random.default_rng(seed)

    def propose(self, token_ids, num_drafts):
        context, out = tuple(token_ids.tolist()), []
        while len(out) < num_drafts and context in self.top:
            ids = self.top[context]
            out.append(int(ids[0] if self.rng.random() < 0.5 else self.rng.choice(ids)))
            context += (out[-1],)
        return out


@pytest.mark.slow   # about 30 s of CPU, over a minute on a loaded machine
def test_engine_sampling_with_drafts_keeps_the_target_distribution(tiny):
    """2,000 completions of 4 tokens of one prompt at temperature 1, top-k 8, through the engine
    with random-accept drafts, against the next-token distributions of HF transformers' forward
    of the same model (torch, float64 softmax). The first token comes from the prefill row; the
    second and third are the first two that the rejection sampler emits (the verify step after
    the prefill carries 2 drafts, one for each; after a rejection the next step carries one for
    the third). Chi-square p > 1e-3 on the first token, on the second given the first (the 8
    conditional distributions pooled) and on the third given the first two (pooled over the
    contexts with >= 20 samples); the least likely tokens of a distribution are merged into
    one bin until it expects >= 5 samples."""
    import torch
    from scipy import stats

    from jaxkv import LLM
    from jaxkv.sample.sampler import SamplingParams

    path, hf_model = tiny
    prompt = tuple(np.random.default_rng(0).integers(3, 400, 17).tolist())
    k, temperature, n = 8, 1.0, 2000

    def target(context):   # softmax(logits / T) over the top k, float64; the top k ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([context])).logits[0, -1].double().numpy()
        order = np.argsort(logits)[::-1]
        assert logits[order[k - 1]] - logits[order[k]] > 1e-3   # no near-tie at the cut
        p = np.zeros_like(logits)
        p[order[:k]] = np.exp((logits[order[:k]] - logits[order[0]]) / temperature)
        return p / p.sum(), order[:k]

    p1, top1 = target(prompt)
    cond2 = {t: target(prompt + (int(t),)) for t in top1}
    cond3 = {(t1, t2): target(prompt + (int(t1), int(t2))) for t1 in top1 for t2 in cond2[t1][1]}
    top = {prompt + (int(t),): ids for t, (_, ids) in cond2.items()}
    top |= {prompt + (int(a), int(b)): ids for (a, b), (_, ids) in cond3.items()}
    with LLM(str(path), max_model_len=64, max_num_seqs=64, max_num_batched_tokens=1280,
             num_kv_blocks=200, block_size=8, token_buckets=(64, 256, 1280), seq_buckets=(64,),
             prefix_caching=None, speculative="ngram", num_speculative_tokens=2,
             speculative_adaptive=False) as llm:
        llm.engine.speculator.proposer = TopKDrafter(top)
        params = [SamplingParams(temperature=temperature, top_k=k, max_tokens=4, seed=i,
                                 ignore_eos=True) for i in range(n)]
        outs = llm.generate([{"prompt_token_ids": list(prompt)}] * n, params, use_tqdm=False)
        s = llm.stats()
    samples = np.array([o.outputs[0].token_ids for o in outs])   # [n, 4]
    accepted, verified = s["spec_num_accepted_tokens"], s["spec_num_draft_tokens"]
    assert verified >= 1.5 * n and 500 < accepted < verified - 500   # both outcomes, often

    def chi2(samples, p):   # (statistic, degrees of freedom) of samples ~ p
        keep = p > 0
        observed = np.bincount(samples, minlength=len(p))
        assert observed[~keep].sum() == 0, "a token outside the top k"
        order = np.argsort(p[keep])   # the least likely tokens merged until >= 5 expected
        observed, expected = observed[keep][order], p[keep][order] * len(samples)
        cut = int(np.searchsorted(np.cumsum(expected), 5.0)) + 1 if expected[0] < 5 else 1
        observed = np.concatenate([[observed[:cut].sum()], observed[cut:]])
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
        return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1

    def pooled_p(parts):
        return stats.chi2.sf(sum(c for c, _ in parts), sum(d for _, d in parts))

    assert pooled_p([chi2(samples[:, 0], p1)]) > 1e-3
    assert pooled_p([chi2(samples[samples[:, 0] == t, 1], cond2[t][0]) for t in top1]) > 1e-3
    parts = []
    for (t1, t2), (p, _) in cond3.items():
        rows = samples[(samples[:, 0] == t1) & (samples[:, 1] == t2), 2]
        if len(rows) >= 20:
            parts.append(chi2(rows, p))
    assert len(parts) >= 20 and sum(d for _, d in parts) >= 60   # enough contexts to test
    assert pooled_p(parts) > 1e-3
