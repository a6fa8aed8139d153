"""Quest sparse decode attention through the engine (``LLM(sparse_attention="quest", ...)``).

* A budget covering the whole sequence selects every live page: greedy tokens equal the dense
  engine's exactly (float, int8 and int4 pools).
* A small budget is checked against an independent float64 numpy oracle of the tiny Llama
  (weights from its transformers checkpoint) that recomputes Quest from scratch for every
  decode query: per block and channel the min/max of the keys so far, page scores
  ``max_g sum_c max(q_c kmin_c, q_c kmax_c)``, the sink / recent pages forced, the top pages,
  attention over exactly those; prefill queries stay dense. The engine's logprobs of its own
  greedy tokens must match the oracle's, and differ from the dense oracle's (the budget bites).
* Speculative steps: verified drafts attend to their own selections, so greedy tokens and
  logprobs equal non-speculative Quest's.
* The ``KeyBounds`` the cache keeps (updated on every write, copied with forked and radix
  partially-copied blocks) equal ``key_bounds`` recomputed from the pool, bit for bit.
* Bad arguments are refused naming the field.
"""

import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.attention.quest import key_bounds
from jaxkv.config import EngineConfig
from numpy_llama import attend_heads, llama_logprobs
from tiny_models import TINY_ENGINE

BS = TINY_ENGINE["block_size"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts(n=3, lo=40, seed=0):
    """``n`` token-id prompts (lengths ``lo`` ... , none leaving a 1-token prefill chunk)."""
    rng = np.random.default_rng(seed)
    return [dict(prompt_token_ids=rng.integers(3, 400, size=lo + 53 * i).tolist())
            for i in range(n)]


def _tokens(path, prompts, params=GREEDY, **kw):
    with LLM(str(path), **{**TINY_ENGINE, **kw}) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kv", ["auto", *(pytest.param(kv, marks=pytest.mark.slow)
                                           for kv in ("int8", "int4"))])
def test_full_budget_equals_dense(tiny, kv):
    prompts = _prompts()
    dense = _tokens(tiny[0], prompts, kv_cache_dtype=kv)
    quest = _tokens(tiny[0], prompts, kv_cache_dtype=kv, sparse_attention="quest",
                    sparse_budget_tokens=TINY_ENGINE["max_model_len"])
    assert quest == dense


# ------------------------------------------------------------------ the float64 oracle

def _quest_keys(q, k, t, *, budget, sinks, recent):
    """Positions kv head h of query position t attends to under Quest: list over heads of int
    arrays. q [G, D] per head group (rotated), k [t + 1, Hkv, D] (rotated)."""
    n = t + 1
    pages = -(-n // BS)
    out = []
    for h in range(k.shape[1]):
        kk = np.full((pages * BS, k.shape[2]), np.nan)
        kk[:n] = k[:, h]
        kk = kk.reshape(pages, BS, -1)
        lo, hi = np.nanmin(kk, 1), np.nanmax(kk, 1)                       # [P, D]
        g = q[h]                                                           # [G, D]
        score = np.maximum(g[:, None] * lo[None], g[:, None] * hi[None]).sum(-1).max(0)
        forced = np.zeros(pages, bool)
        forced[:-(-sinks // BS)] = True
        forced[max(n - recent, 0) // BS:] = True
        forced[n // BS:] = True
        order = sorted(range(pages), key=lambda p: (not forced[p], -score[p], p))[:budget]
        keep = np.zeros(n, bool)
        for p in order:
            keep[p * BS:(p + 1) * BS] = True
        out.append(np.nonzero(keep[:n])[0])
    return out


def oracle_logprobs(model, tokens, num_prompt, *, budget=None, sinks=0, recent=1):
    """float64 log-softmax [T, V] of the tiny Llama on ``tokens``; queries at positions
    ``>= num_prompt`` (the decode tokens) attend through Quest when ``budget`` is set."""

    def attend(t, q, k, v, rope):
        qr = rope(q[t], t)                                                 # [H, D]
        kr = rope(k[:t + 1], np.arange(t + 1)[:, None])                    # [t + 1, Hkv, D]
        if budget is not None and t >= num_prompt:
            keys = _quest_keys(qr.reshape(k.shape[1], -1, qr.shape[-1]), kr, t, budget=budget,
                               sinks=sinks, recent=recent)
        else:
            keys = np.arange(t + 1)
        return attend_heads(qr, kr, v[:t + 1], keys)

    return llama_logprobs(model, tokens, attend)


def test_small_budget_matches_quest_oracle(tiny):
    """6 pages of 8 (sinks 4, recent 8) over sequences of up to 150 positions."""
    path, model = tiny
    budget, sinks, recent = 6, 4, 8
    prompts = _prompts(n=2, lo=70, seed=1)        # 70 and 123 tokens: chunks 64 + 6, 64 + 59
    params = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(str(path), **TINY_ENGINE, sparse_attention="quest",
             sparse_budget_tokens=budget * BS, kv_sink_tokens=sinks,
             sparse_recent_tokens=recent) as llm:
        outs = [llm.generate([p], params)[0].outputs[0] for p in prompts]   # one at a time
    worst_sparse, best_dense = 0.0, 0.0
    for prompt, out in zip(prompts, outs):
        ids, L = prompt["prompt_token_ids"], len(prompt["prompt_token_ids"])
        seq = ids + list(out.token_ids)
        got = np.array([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
        ref = oracle_logprobs(model, seq[:-1], L, budget=budget, sinks=sinks, recent=recent)
        dense = oracle_logprobs(model, seq[:-1], L)
        rows = np.arange(L - 1, len(seq) - 1)
        want = ref[rows, out.token_ids]
        assert (ref[rows].argmax(-1) == np.array(out.token_ids)).all()
        worst_sparse = max(worst_sparse, np.abs(got - want).max())
        best_dense = max(best_dense, np.abs(got - dense[rows, out.token_ids]).max())
    assert worst_sparse < 2e-4
    assert best_dense > 1e-2        # the selection really dropped pages that mattered


def test_verified_drafts_attend_to_their_own_selection(tiny, monkeypatch):
    """Speculative steps under Quest: each draft verified in a multi-token step attends to its
    own selection at its own length, as the decode step that would have computed it does, so
    greedy tokens and their logprobs equal non-speculative Quest's (drafts from the known
    continuation, 30% replaced at random; a 6-page budget that bites, as in the oracle test)."""
    from oracle_proposer import OracleProposer

    prompts = _prompts(n=2, lo=70, seed=1)
    params = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, logprobs=0)
    kw = dict(sparse_attention="quest", sparse_budget_tokens=6 * BS, kv_sink_tokens=4,
              sparse_recent_tokens=8)

    def run(llm):
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [o.token_ids for o in outs], [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
                                             for o in outs]

    with LLM(str(tiny[0]), **TINY_ENGINE, **kw) as llm:
        want, want_lp = run(llm)
    references = {tuple(p["prompt_token_ids"]): tuple(t) for p, t in zip(prompts, want)}
    with LLM(str(tiny[0]), **TINY_ENGINE, **kw, speculative="ngram", num_speculative_tokens=4,
             speculative_adaptive=False) as llm:
        monkeypatch.setattr(llm.engine.speculator, "proposer", OracleProposer(references, 0.3))
        got, got_lp = run(llm)
        stats = llm.stats()
    assert got == want
    np.testing.assert_allclose(np.array(got_lp), np.array(want_lp), atol=2e-4, rtol=0)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


@pytest.mark.parametrize("kv", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
def test_pallas_sparse_kernel_in_the_engine(tiny, kv):
    """impl="pallas" (interpret mode) runs jaxkv.attention.pallas.sparse_paged_decode_attention on
    the decode rows: the same tokens and logprobs as the jnp spec's grouped engine."""
    prompts = _prompts(n=2, lo=40, seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    kw = dict(kv_cache_dtype=kv, sparse_attention="quest", sparse_budget_tokens=6 * BS,
              sparse_recent_tokens=BS)
    got = {}
    for impl in ("grouped", "pallas"):
        with LLM(str(tiny[0]), **TINY_ENGINE, **kw, attention_impl=impl,
                 interpret=impl == "pallas") as llm:
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        got[impl] = ([o.token_ids for o in outs],
                     np.array([[lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]))
    assert got["pallas"][0] == got["grouped"][0]
    np.testing.assert_allclose(got["pallas"][1], got["grouped"][1], atol=1e-4, rtol=0)


# ------------------------------------------------------------------ the cache's key bounds

@pytest.mark.parametrize("kv", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
def test_bounds_equal_key_bounds_from_scratch(tiny, kv):
    """After every step, on every block of every running sequence, through prefix hits
    (radix: partial blocks copied) and forks (n = 2: copy-on-write of the last block)."""
    shared = _prompts(n=1, lo=45, seed=2)[0]["prompt_token_ids"]
    prompts = [dict(prompt_token_ids=shared + [5, 6, 7]), dict(prompt_token_ids=shared[:43])]
    with LLM(str(tiny[0]), **TINY_ENGINE, kv_cache_dtype=kv, prefix_caching="radix",
             sparse_attention="quest", sparse_budget_tokens=4 * BS,
             sparse_recent_tokens=BS) as llm:
        core = llm.engine
        core.add_request(prompts[0], SamplingParams(max_tokens=12, temperature=0.0))
        steps = checked = hits = 0
        while core.has_unfinished_requests():
            if steps == 4:
                core.add_request(prompts[1], SamplingParams(max_tokens=10, n=2, seed=3,
                                                            temperature=1.0))
            core.step()
            steps += 1
            state = core.scheduler_state
            seqs = [s for s in state.running if state.requests[s].num_computed_tokens]
            if not seqs:
                continue
            hits = max(hits, *(state.requests[s].num_cached_tokens for s in seqs))
            tables = [state.block_manager.block_table(s) for s in seqs]
            width = max(map(len, tables))
            tables = np.array([t + (0,) * (width - len(t)) for t in tables], np.int32)
            lens = np.array([state.requests[s].num_computed_tokens for s in seqs], np.int32)
            cache = core.runner.cache
            for layer, bounds in enumerate(cache.bounds):
                ref = key_bounds(cache.k[layer], tables, lens)
                used = np.unique(tables[tables > 0])
                np.testing.assert_array_equal(np.asarray(bounds.kmin)[used],
                                              np.asarray(ref.kmin)[used])
                np.testing.assert_array_equal(np.asarray(bounds.kmax)[used],
                                              np.asarray(ref.kmax)[used])
            checked += 1
        assert checked > 10 and hits >= 40          # the radix hit covered the shared prefix


def test_pool_bytes_count_the_bounds(tiny):
    with LLM(str(tiny[0]), **TINY_ENGINE, sparse_attention="quest",
             sparse_budget_tokens=64) as llm:
        r = llm.engine.runner
        assert r.kv_spec.key_bounds and len(r.cache.bounds) == r.model_config.num_layers
        assert r.cache.nbytes == r.kv_spec.nbytes
        assert r.memory_plan.kv_bytes_per_block == r.kv_spec.block_bytes
        c = r.model_config
        plain = 2 * c.num_layers * BS * c.num_kv_heads * c.head_dim * 4
        assert r.kv_spec.block_bytes == plain + 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    with LLM(str(tiny[0]), **TINY_ENGINE, kv_cache_dtype="int4", sparse_attention="quest",
             sparse_budget_tokens=64) as llm:
        assert llm.engine.runner.cache.bounds == ()      # KIVI: from its scale / zero point


# ------------------------------------------------------------------ refused arguments

@pytest.mark.parametrize("kwargs, field", [
    (dict(sparse_attention="quest"), "sparse_budget_tokens"),
    (dict(sparse_budget_tokens=64), "sparse_budget_tokens"),
    (dict(sparse_attention="h2o", sparse_budget_tokens=64), "sparse_attention"),
    (dict(sparse_attention="quest", sparse_budget_tokens=0), "sparse_budget_tokens"),
    (dict(sparse_attention="quest", sparse_budget_tokens=64, sparse_recent_tokens=0),
     "sparse_recent_tokens"),
    (dict(sparse_attention="quest", sparse_budget_tokens=64, kv_retention="streaming",
          kv_window_tokens=60), "kv_retention"),
])
def test_bad_config_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(sparse_budget_tokens=16, sparse_recent_tokens=32), "sparse_budget_tokens"),
    (dict(sparse_budget_tokens=64, kv_cache_dtype="int4", kv_residual_blocks=8),
     "kv_residual_blocks"),
])
def test_budget_below_forced_pages_refused(tiny, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny[0]), **TINY_ENGINE, sparse_attention="quest", **kwargs)
