"""Greedy decoding on SmolLM2-135M with an fp8 / int8 KV cache agrees with the fp32 cache on a
documented fraction of tokens (positional agreement over 3 prompts x 32 tokens)."""

import pytest

from jaxkv import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              num_kv_blocks=64, token_buckets=(16, 64), seq_buckets=(4,))
PROMPTS = ["It is a truth universally acknowledged, that a single man in possession",
           "The capital of France is", "Emma Woodhouse, handsome, clever, and rich,"]
# measured on this CPU: fp8_e4m3 53/96, int8 84/96 positions equal (one near-tie flip makes
# the rest of a 32-token continuation differ); floors a little below that
MIN_AGREEMENT = {"fp8_e4m3": 0.5, "int8": 0.8}


def greedy(kv):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(kv_cache_dtype=kv, **ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow
def test_smollm2_fp8_and_int8_cache_agree_with_fp32():
    ref = greedy("fp32")
    for kv, floor in MIN_AGREEMENT.items():
        got = greedy(kv)
        same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
        assert same / sum(map(len, ref)) >= floor, kv
