"""The hybrid KV cache through the engine: a tiny Gemma 3 (7 layers, window 16: one full group,
six sliding groups over one pool slot) gives exactly the tokens of the same engine with every
layer keeping every block (``hybrid_kv_cache=False``), per KV format, with forks, swap
preemption to the host tier, speculative decoding and beam search, while its sliding groups
hold only their windows."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxkv import LLM, SamplingParams  # noqa: E402
from jaxkv.engine.beam_search import BeamSearchParams  # noqa: E402
from tiny_models import austen_text, save_tiny_model, save_tokenizer  # noqa: E402

ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
              token_buckets=(8, 32), seq_buckets=(4,), prefix_caching="hash")
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    save_tokenizer(path)
    save_tiny_model(path, "gemma3_text", num_hidden_layers=7, head_dim=32, sliding_window=16,
                    query_pre_attn_scalar=24)
    return path


def _prompts(llm):
    ids = llm.tokenizer.encode(austen_text(6000))
    return [ids[:96] + ids[200:230], ids[300:420], ids[:96] + ids[500:520], ids[600:610]]


def _run(path, n=1, **kw):
    """Tokens and logprobs of the four prompts (the last two after the first two finish, so
    they find the first's prefix), the stats, and the peak blocks of each group."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0,
                            n=n)
    with LLM(str(path), **{**ENGINE, **kw}) as llm:
        prompts = _prompts(llm)
        outs = []
        for batch in (prompts[:2], prompts[2:]):
            ids = llm.engine.add_requests([dict(prompt={"prompt_token_ids": p},
                                                sampling_params=params) for p in batch])
            done, peak = {}, None
            while llm.engine.has_unfinished_requests():
                done.update((i, o) for i, o in llm.engine.step().items() if o.finished)
                llm.engine.check_invariants()
                held = llm.stats()["kv_blocks_per_group"]
                peak = held if peak is None else tuple(map(max, peak, held))
            outs += [done[i] for i in ids]
        stats = llm.stats()
    got = [[(c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)])
            for c in o.outputs] for o in outs]
    return got, stats, peak


def _same(a, b, exact=True):
    for ra, rb in zip(a, b, strict=True):
        for (ta, la), (tb, lb) in zip(ra, rb, strict=True):
            assert ta == tb
            np.testing.assert_allclose(la, lb, atol=0 if exact else 1e-5, rtol=0)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("kw", [
    pytest.param(dict(), id="float", marks=SLOW),
    pytest.param(dict(kv_cache_dtype="int4"), id="kivi-int4"),
    pytest.param(dict(n=2), id="forks", marks=SLOW),
    pytest.param(dict(kv_cache_dtype="int8"), id="int8", marks=SLOW),
    pytest.param(dict(kv_cache_dtype="fp8"), id="fp8", marks=SLOW),
    pytest.param(dict(speculative="ngram", num_speculative_tokens=3), id="ngram", marks=SLOW)])
def test_hybrid_gives_the_full_caches_tokens(gemma3, kw):
    """Bit-exact: the sliding layers read the same window either way (the blocks below it
    are masked, or null); the sliding groups hold at most (16 - 1 + 32) // 8 + 2 = 7 blocks
    each, while the full group holds every block."""
    want, _, full_peak = _run(gemma3, hybrid_kv_cache=False, **kw)
    got, stats, peak = _run(gemma3, **kw)
    _same(got, want)
    assert len(peak) == 7 and len(full_peak) == 1
    assert max(peak[1:]) <= 4 * 7 * (1 + (kw.get("n", 1) > 1))
    assert peak[0] > max(peak[1:])
    assert stats["prefix_cache_hits"] > 0


def test_swap_preemption_and_beam_search_per_group(gemma3):
    """A pool too small for the four requests: swapped-out sequences (every group's table)
    come back from the host tier with the tokens of an unconstrained run; beam search forks
    every group's blocks and gives the full cache's beams."""
    want, _, _ = _run(gemma3, hybrid_kv_cache=False, num_kv_blocks=400)
    got, stats, _ = _run(gemma3, num_kv_blocks=80, kv_offload_bytes=1 << 20,
                         preemption_mode="swap")
    assert stats["num_swap_preemptions"] > 0
    _same(got, want, exact=False)
    beams = BeamSearchParams(beam_width=3, max_tokens=12)
    outs = []
    for hybrid in (False, True):
        with LLM(str(gemma3), **ENGINE, hybrid_kv_cache=hybrid) as llm:
            prompts = [{"prompt_token_ids": p} for p in _prompts(llm)[:2]]
            outs.append([[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, beams)])
    assert outs[0] == outs[1]


def test_kivi_residual_must_fit_the_window(gemma3):
    with pytest.raises(ValueError, match="kv_residual_blocks=3.*sliding_window=16"):
        LLM(str(gemma3), **ENGINE, kv_cache_dtype="int4", kv_residual_blocks=3)


def test_prefix_hits_through_every_group_are_bit_exact(gemma3):
    """The third request finds the first's 96-token prefix (12 blocks: the full group all of
    them, each sliding group the 2 its window reaches back to) and gives bit for bit the
    tokens and logprobs of the run without a prefix cache."""
    want, _, _ = _run(gemma3, prefix_caching=None)
    got, stats, _ = _run(gemma3)
    assert stats["prefix_cache_hits"] == 96
    _same(got, want)


def test_prefix_blocks_through_the_host_tier_and_disk_give_the_same_tokens(gemma3, tmp_path):
    """Every group's cached blocks go to the host tier as the pool reuses them, and to disk
    at close: the third request's prefix comes back from the host (a pool of 90 blocks), and
    after a restart on the same ``kv_cache_dir`` from disk; the tokens of the run without a
    prefix cache both times (logprobs within 1e-5: the small pool batches differently)."""
    want, _, _ = _run(gemma3, prefix_caching=None)
    kw = dict(num_kv_blocks=90, kv_offload_bytes=1 << 20, kv_cache_dir=str(tmp_path))
    got, stats, _ = _run(gemma3, **kw)
    assert stats["prefix_cache_hits_host"] > 0
    _same(got, want, exact=False)
    again, stats, _ = _run(gemma3, **kw)
    assert stats["prefix_cache_hits_disk"] > 0
    _same(again, want, exact=False)
