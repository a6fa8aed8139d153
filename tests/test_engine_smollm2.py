"""The engine end to end with the Pallas kernels (interpret mode) on the default real model."""

import pytest

from jaxkv import LLM, SamplingParams

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64,
              token_buckets=(16, 64), seq_buckets=(8,))


@pytest.mark.slow
def test_smollm2_greedy_tokens_pallas_interpret_equal_reference():
    prompts = ["It is a truth universally acknowledged, that a single man in possession",
               "The capital of France is", "Emma Woodhouse, handsome, clever, and rich,"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(attention_impl="pallas", interpret=True, **ENGINE) as llm:
        assert llm.attention_impl == "pallas"
        pallas = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(attention_impl="reference", **ENGINE) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert pallas == reference
