"""The draft-model proposer (jaxkv/spec_decode/draft_model.py) on the tiny models: the
incrementally synced draft cache proposes what a fresh one does; greedy and seeded outputs with a
draft (the target itself, which must accept every draft; a truncated target, which accepts some; a
different random model) equal non-speculative decoding token for token, through block boundaries
and preemption; the draft blocks are given back exactly when requests finish or abort; the
configuration errors name ``speculative_model``."""

import argparse

import numpy as np
import pytest

from jaxkv.blocks.block_manager import cdiv

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=96,
              block_size=8, token_buckets=(16, 64), seq_buckets=(8,))


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    """{name: path}: ``tiny`` (the conftest model, 2 layers), ``other`` (another random model,
    same tokenizer), ``deep`` (4 layers) and ``cut`` (its layers 0, 1 and 3, written by
    ``write_truncated_draft``)."""
    from jaxkv.spec_decode.draft_model import write_truncated_draft
    from tiny_models import save_tiny_model, save_tokenizer

    out = {"tiny": tiny[0]}
    for name, kw in (("other", dict(seed=1)), ("deep", dict(seed=2, num_hidden_layers=4))):
        out[name] = tmp_path_factory.mktemp(name)
        save_tokenizer(out[name])
        save_tiny_model(out[name], **kw)
    out["cut"] = write_truncated_draft(str(out["deep"]), str(tmp_path_factory.mktemp("cut")),
                                       [0, 1, 3])
    return out


def engine(target, draft=None, k=4, **kw):
    from jaxkv import LLM

    spec = (dict(speculative="draft", speculative_model=str(draft), num_speculative_tokens=k,
                 speculative_adaptive=False) if draft else {})
    return LLM(str(target), **{**ENGINE, **kw}, **spec)


@pytest.fixture(scope="module")
def same_llm(models):
    with engine(models["tiny"], models["tiny"]) as llm:
        yield llm


@pytest.fixture(scope="module")
def deep_llm(models):
    with engine(models["deep"]) as llm:
        yield llm


@pytest.fixture(scope="module")
def cut_llm(models):
    with engine(models["deep"], models["cut"], k=3) as llm:
        yield llm


def token_lists(outs):
    return [o.outputs[0].token_ids for o in outs]


def draft_of(llm):
    return llm.engine.speculator.proposer


def spec_delta(llm, before):
    after = llm.stats()
    return {k: after[k] - before[k] for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens")}


def test_synced_draft_cache_proposes_what_a_fresh_one_does(models, tiny_llm):
    """propose_batch over histories that grow by accepted drafts and corrections (two
    requests following the target's greedy continuation) or by tokens the drafts never
    predict (one random history: every draft rejected), so the cache is rewound and caught up
    incrementally: the drafts equal those of a fresh proposer that computes the whole history;
    with the target as its own draft they are the target's greedy continuation; the table
    always holds exactly ``L + k - 1`` tokens."""
    from jaxkv.config import EngineConfig
    from jaxkv.sample.sampler import SamplingParams
    from jaxkv.spec_decode.draft_model import DraftModelProposer
    from tiny_models import austen_prompts

    prompts = austen_prompts(2, seed=4, max_chars=50)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    rng = np.random.default_rng(0)
    full = {i: np.array(o.prompt_token_ids + o.outputs[0].token_ids, np.int32)
            for i, o in enumerate(outs)}
    full[2] = rng.integers(3, 400, size=120).astype(np.int32)
    lengths = {0: len(outs[0].prompt_token_ids), 1: len(outs[1].prompt_token_ids), 2: 30}
    config = EngineConfig.from_kwargs(model=str(models["tiny"]), **ENGINE, speculative="draft",
                                      speculative_model=str(models["tiny"]))
    synced = DraftModelProposer.from_config(config, tiny_llm.engine.runner)
    fresh = DraftModelProposer.from_config(config, tiny_llm.engine.runner)   # its own cache
    bm = synced.block_manager
    try:
        for step in range(12):
            ks = {i: int(rng.integers(1, 5)) for i in full}
            asked = {i: (full[i][:lengths[i]], ks[i]) for i in full}
            got = synced.propose_batch(asked)
            assert fresh.propose_batch(asked) == got, step
            for i in full:
                assert len(got[i]) == ks[i]
                assert len(bm.block_table(i)) == cdiv(lengths[i] + ks[i] - 1, bm.block_size)
                fresh.release(i)
            for i in (0, 1):
                assert got[i] == tuple(full[i][lengths[i]:lengths[i] + ks[i]].tolist()), step
            assert fresh.block_manager.num_free_blocks == fresh.block_manager.num_blocks - 1
            lengths = {i: lengths[i] + int(rng.integers(1, ks[i] + 2)) for i in full}
            bm.check_invariants()
        for i in full:
            synced.release(i)
        assert bm.num_free_blocks == bm.num_blocks - 1
    finally:
        synced.close()
        fresh.close()


def test_a_full_draft_pool_gives_no_drafts_to_what_does_not_fit(models, tiny_llm):
    """Requests whose draft K/V does not fit in the free draft blocks get no drafts (and hold
    no draft blocks); the ones before them in urgency order keep theirs."""
    from jaxkv.config import EngineConfig
    from jaxkv.spec_decode.draft_model import DraftModelProposer

    config = EngineConfig.from_kwargs(model=str(models["tiny"]), **ENGINE, speculative="draft",
                                      speculative_model=str(models["tiny"]))
    proposer = DraftModelProposer.from_config(config, tiny_llm.engine.runner, num_blocks=34)
    bm = proposer.block_manager   # 33 usable blocks of 8 tokens
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(3, 400, size=n).astype(np.int32) for n in (150, 120, 5))
    try:   # a: 153 tokens in 20 blocks; b would need 16 of the 13 left; c: 1
        got = proposer.propose_batch({"a": (a, 4), "b": (b, 4), "c": (c, 2)})
        assert set(got) == {"a", "c"} and len(got["a"]) == 4 and len(got["c"]) == 2
        assert set(bm.request_ids()) == {"a", "c"} and bm.num_free_blocks == 33 - 20 - 1
        proposer.release("a")
        got = proposer.propose_batch({"b": (b, 4)})
        assert set(got) == {"b"} and len(bm.block_table("b")) == 16
        bm.check_invariants()
    finally:
        proposer.close()


def test_own_model_as_draft_accepts_every_draft(tiny_llm, same_llm):
    """Greedy, 6 prompts at once, 60 tokens (block size 8): token-exact, every draft accepted,
    fewer target steps, every draft block given back."""
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    prompts = austen_prompts(6, seed=5, max_chars=120)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    steps = tiny_llm.stats()["num_steps"]
    want = token_lists(tiny_llm.generate(prompts, params, use_tqdm=False))
    steps = tiny_llm.stats()["num_steps"] - steps
    before = same_llm.stats()
    assert token_lists(same_llm.generate(prompts, params, use_tqdm=False)) == want
    d = spec_delta(same_llm, before)
    assert d["spec_num_accepted_tokens"] == d["spec_num_draft_tokens"] > 0
    assert same_llm.stats()["num_steps"] - before["num_steps"] < steps / 3
    bm = draft_of(same_llm).block_manager
    assert bm.num_free_blocks == bm.num_blocks - 1 and same_llm.stats()["kv_blocks_used"] == 0
    same_llm.engine.check_invariants()


@pytest.mark.parametrize("params", [
    pytest.param(dict(temperature=0, max_tokens=50, ignore_eos=True), marks=pytest.mark.slow),
    dict(temperature=0.9, top_k=50, seed=11, repetition_penalty=1.3, min_tokens=30,
         max_tokens=45),
    dict(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True),
])
def test_truncated_draft_keeps_greedy_and_seeded_outputs(deep_llm, cut_llm, params):
    """A draft that is right some of the time: greedy and seeded (penalties, min_tokens)
    outputs and logprobs equal the non-speculative run's."""
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    params = SamplingParams(**params)
    prompts = austen_prompts(5, seed=9, max_chars=80)
    want = deep_llm.generate(prompts, params, use_tqdm=False)
    before = cut_llm.stats()
    got = cut_llm.generate(prompts, params, use_tqdm=False)
    assert token_lists(got) == token_lists(want)
    assert [o.outputs[0].cumulative_logprob for o in got] == pytest.approx(
        [o.outputs[0].cumulative_logprob for o in want], abs=1e-3)
    d = spec_delta(cut_llm, before)
    assert 0 < d["spec_num_accepted_tokens"] < d["spec_num_draft_tokens"]
    assert draft_of(cut_llm).stats()["spec_draft_blocks_used"] == 0


def test_other_random_draft_and_adaptive_length(models, tiny_llm):
    """A different random model (same vocabulary): drafts almost never accepted, outputs equal;
    with the adaptive length (the default) too, verifying fewer drafts, its cost measured in
    the engine (the draft's forwards against the target's plain steps)."""
    from jaxkv import LLM
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    prompts = austen_prompts(4, seed=21, max_chars=80)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = token_lists(tiny_llm.generate(prompts, params, use_tqdm=False))
    verified = []
    with LLM(str(models["tiny"]), **ENGINE, speculative="draft",
             speculative_model=str(models["other"]), num_speculative_tokens=4) as llm:
        for cost in (None, 0.1):
            llm.engine.speculator.draft_cost = cost
            before = llm.stats()
            assert token_lists(llm.generate(prompts, params, use_tqdm=False)) == want
            verified.append(spec_delta(llm, before)["spec_num_draft_tokens"])
        assert draft_of(llm).stats()["spec_draft_blocks_used"] == 0
        # the adaptive rule weighs the target's measured steps and the draft's forwards
        spec, n = llm.engine.speculator, len(prompts)
        plain = spec.step_cost.predict(n, n, False)
        forward = draft_of(llm).forward_cost.predict(n, n, False)
        assert plain > 0 and forward > 0
        assert spec.proposal_time(n, 3) == pytest.approx(3 * forward)
    assert verified[1] < verified[0] / 3


def test_a_warm_engine_measures_each_shape_in_one_step(models):
    """With ``warmup`` every shape is compiled at start, so the first duration of a shape is a
    step's and is kept: after one decode step the target's plain step has a time, and after
    one two-token proposal the draft's decode forward has one (without a warm-up both first
    durations hold a compilation and are dropped)."""
    from jaxkv import LLM
    from jaxkv.sample.sampler import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    history = np.arange(3, 23, dtype=np.int32)
    measured = []
    for warmup in (False, True):
        with LLM(str(models["tiny"]), **ENGINE, speculative="draft",
                 speculative_model=str(models["other"]), num_speculative_tokens=4,
                 warmup=warmup) as llm:
            llm.generate([{"prompt_token_ids": history.tolist()}], params, use_tqdm=False)
            draft = draft_of(llm)
            assert len(draft.propose_batch({"r": (history, 2)})["r"]) == 2
            draft.release("r")
            measured.append((llm.engine.speculator.step_cost.predict(1, 1, False),
                             draft.forward_cost.predict(1, 1, False)))
    assert measured[0] == (None, None)
    assert all(t is not None and t > 0 for t in measured[1])


@pytest.mark.slow
def test_preemption_with_a_small_pool(models, tiny_llm):
    """A target pool too small for the batch: requests are preempted (their draft state
    released, caught up again on readmission) and the outputs stay token-exact."""
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    prompts = austen_prompts(6, seed=17, max_chars=100)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = token_lists(tiny_llm.generate(prompts, params, use_tqdm=False))
    with engine(models["tiny"], models["tiny"], num_kv_blocks=24, max_model_len=128) as llm:
        assert token_lists(llm.generate(prompts, params, use_tqdm=False)) == want
        s = llm.stats()
        assert s["num_preemptions"] > 0 and s["spec_num_accepted_tokens"] > 0
        bm = draft_of(llm).block_manager
        assert bm.num_free_blocks == bm.num_blocks - 1
        assert bm.num_blocks == 24 + 8 * (cdiv(4, 8) + 1)   # the default draft pool


def test_draft_blocks_follow_the_requests(same_llm):
    """Stepped by hand: the draft holds tables for exactly the running decodes, each of its
    drafted length; an abort and a finish give back exactly their blocks."""
    from jaxkv.sample.sampler import SamplingParams
    from tiny_models import austen_prompts

    core, proposer = same_llm.engine, draft_of(same_llm)
    bm = proposer.block_manager
    free = bm.num_free_blocks
    prompts = austen_prompts(3, seed=23, max_chars=60)
    for i, (p, n) in enumerate(zip(prompts, (30, 12, 30))):
        core.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                         request_id=f"r{i}")
    for _ in range(3):
        core.step()
    state = core.scheduler_state
    assert set(bm.request_ids()) == set(state.running) == {"r0#0", "r1#0", "r2#0"}
    for i in state.running:   # the last proposal: L tokens + k - 1 drafts, k <= 4
        rs = state.requests[i]
        assert len(bm.block_table(i)) <= cdiv(rs.num_tokens + 3, bm.block_size)
    held = len(bm.block_table("r2#0"))
    before = bm.num_free_blocks
    core.abort_request("r2")
    assert "r2#0" not in bm and bm.num_free_blocks == before + held
    while "r1#0" in core.scheduler_state.requests:
        core.step()
    assert set(bm.request_ids()) == {"r0#0"}
    while core.has_unfinished_requests():
        core.step()
    assert bm.num_free_blocks == free == bm.num_blocks - 1
    bm.check_invariants()
    core.check_invariants()


def test_reduced_head_draft_proposes_the_argmax_among_its_tokens(models, tiny, tiny_llm,
                                                                 tmp_path):
    """The tiny model as its own draft with an LM head over a third of the vocabulary
    (``write_reduced_head_draft``): its greedy drafts, chained, are the float64 reference's
    argmax among those tokens (mapped back to token ids), at every position whose top-2 gap
    among them is not a near-tie; with a head over every token the target emits, they are the
    target's greedy continuation."""
    from jaxkv.config import EngineConfig
    from jaxkv.sample.sampler import SamplingParams
    from jaxkv.spec_decode.draft_model import DraftModelProposer, write_reduced_head_draft
    from numpy_llama import attend_heads, llama_logprobs
    from tiny_models import austen_prompts

    def dense(t, q, k, v, rope):
        keys = np.arange(t + 1)
        return attend_heads(rope(q[t], t), rope(k[keys], keys[:, None]), v[keys], keys)

    vocab = tiny[1].config.vocab_size
    outs = tiny_llm.generate(austen_prompts(3, seed=7, max_chars=60),
                             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)
    histories = [np.array(o.prompt_token_ids, np.int32) for o in outs]
    continuations = [list(o.outputs[0].token_ids) for o in outs]
    rng = np.random.default_rng(3)
    third = rng.permutation(vocab)[:vocab // 3]
    emitted = np.unique(np.concatenate([third, *map(np.asarray, continuations)]))
    for ids, follows_target in ((third, False), (rng.permutation(emitted), True)):
        path = write_reduced_head_draft(str(models["tiny"]), str(tmp_path / f"h{len(ids)}"), ids)
        config = EngineConfig.from_kwargs(model=str(models["tiny"]), **ENGINE,
                                          speculative="draft", speculative_model=str(path))
        proposer = DraftModelProposer.from_config(config, tiny_llm.engine.runner)
        try:
            assert proposer.runner.model_config.num_logits == len(ids)
            got = proposer.propose_batch({i: (h, 4) for i, h in enumerate(histories)})
        finally:
            proposer.close()
        checked = 0
        for i, history in enumerate(histories):
            tokens = list(history)
            for draft in got[i]:
                scores = llama_logprobs(tiny[1], np.array(tokens), dense)[-1][ids]
                top2 = np.sort(scores)[-2:]
                if top2[1] - top2[0] < 1e-4:   # a near-tie: fp32 may pick either
                    break
                assert draft == ids[np.argmax(scores)]
                checked += 1
                tokens.append(draft)
            if follows_target:
                assert list(got[i]) == continuations[i][:4]
        assert checked >= 10


def test_configuration_errors_name_speculative_model(models, tmp_path):
    from jaxkv import LLM
    from jaxkv.config import EngineConfig
    from tiny_models import austen_text, save_tiny_model, save_tokenizer

    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig.from_kwargs(speculative="draft")
    small = tmp_path / "small"
    save_tokenizer(small)
    save_tiny_model(small, vocab_size=300)
    with pytest.raises(ValueError, match=r"speculative_model=.*vocab_size=300 differs"):
        LLM(str(models["tiny"]), **ENGINE, speculative="draft", speculative_model=str(small))
    retrained = tmp_path / "retrained"   # same vocabulary size, another tokenizer
    save_tokenizer(retrained, text=austen_text(book="mansfield_park"))
    save_tiny_model(retrained)
    with pytest.raises(ValueError, match=r"speculative_model=.*tokenizer"):
        LLM(str(models["tiny"]), **ENGINE, speculative="draft", speculative_model=str(retrained))
    from jaxkv.spec_decode.draft_model import write_reduced_head_draft

    for ids in ([1, 1, 2], [0, 400], []):
        with pytest.raises(ValueError, match="token_ids"):
            write_reduced_head_draft(str(models["tiny"]), str(tmp_path / "head"), ids)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli(parser.parse_args(
        ["--speculative", "draft", "--speculative-model", str(models["cut"]),
         "--num-speculative-tokens", "3"]))
    assert (config.speculative.speculative, config.speculative.speculative_model,
            config.speculative.max_drafts) == ("draft", str(models["cut"]), 3)
