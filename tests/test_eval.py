"""jaxkv.entrypoints.eval against independent references: perplexity through the paged engine path equals
HF transformers' strided perplexity on the same windows; teacher-forced agreement of the fp32 cache
with the engine's own greedy continuation is exact; quantized caches order as their bits."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxkv import LLM  # noqa: E402
from jaxkv.entrypoints.eval import perplexity, token_agreement  # noqa: E402
from jaxkv.sample.sampler import SamplingParams  # noqa: E402
from tiny_models import austen_text  # noqa: E402

ENGINE = dict(max_model_len=128, max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=20,
              block_size=8, token_buckets=(16, 64), seq_buckets=(1,), prefix_caching=None)


def hf_perplexity(model, ids, context, stride):
    """HF's strided perplexity (the docs' recipe): each window scores its last ``stride`` tokens,
    the first window all of them but the first."""
    total, count = 0.0, 0
    for w, start in enumerate(range(0, len(ids) - context, stride)):
        window = torch.tensor(ids[start:start + context + 1])[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(window[:, :-1]).logits.double(), -1)[0]
        nll = -logp.gather(1, window[0, 1:, None])[:, 0].numpy()
        first = 0 if w == 0 else context - stride
        total += nll[first:].sum()
        count += len(nll) - first
    return math.exp(total / count), count


def test_perplexity_equals_hf_transformers(tiny):
    path, model = tiny
    with LLM(str(path), **ENGINE) as llm:
        ids = llm.tokenizer.encode(austen_text(6_000))[:400]
        got = perplexity(llm.engine.runner, ids, kv_cache_dtype="fp32", context=96, stride=48, chunk=32)
    want, count = hf_perplexity(model, ids, 96, 48)
    assert got.num_scored == count
    np.testing.assert_allclose(got.perplexity, want, rtol=1e-5)


def test_perplexity_logs_its_windows_and_shows_their_progress(tiny, caplog, capsys):
    with LLM(str(tiny[0]), **ENGINE) as llm, caplog.at_level("INFO", logger="jaxkv"):
        ids = llm.tokenizer.encode(austen_text(6_000))[:400]
        r = perplexity(llm.engine.runner, ids, kv_cache_dtype="fp32", context=96, stride=48,
                       chunk=32, progress=True)
    assert r.num_windows == 7 and "perplexity: 7 windows of 96 tokens" in caplog.text
    bar = capsys.readouterr().err
    assert "Perplexity: 100%" in bar and "7/7" in bar


@pytest.mark.slow
def test_token_agreement_of_the_fp32_cache_with_engine_greedy_is_exact(tiny):
    path, _ = tiny
    with LLM(str(path), kv_cache_dtype="fp32", **ENGINE) as llm:
        prompt = llm.tokenizer.encode(austen_text(2_000))[:40]
        ref = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        fp32 = token_agreement(llm.engine.runner, prompt, ref, kv_cache_dtype="fp32", prefill_chunk=16)
        int2 = token_agreement(llm.engine.runner, prompt, ref, kv_cache_dtype="int2", prefill_chunk=16)
        with pytest.raises(ValueError, match="reference_ids"):
            token_agreement(llm.engine.runner, prompt, [], kv_cache_dtype="fp32")
    assert fp32.agreement == 1.0 and fp32.first_difference == len(ref)
    assert fp32.argmax == tuple(ref)
    assert int2.agreement < 1.0
