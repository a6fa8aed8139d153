"""The engine end to end on the default real model (SmolLM2-135M GGUF): HF parity, and the Pallas
kernels (interpret mode) and the default CPU attention (grouped) against the reference."""

import pytest

from jaxkv import LLM, SamplingParams

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64,
              token_buckets=(16, 64), seq_buckets=(8,))
PROMPTS = ["It is a truth universally acknowledged, that a single man in possession",
           "The capital of France is", "Emma Woodhouse, handsome, clever, and rich,"]


@pytest.mark.slow
def test_smollm2_generate_greedy_equals_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)   # = HF min_new_tokens
    with LLM(dtype="float32", **ENGINE) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        path = llm.engine.runner.model_path
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for o in outs:
        with torch.no_grad():
            want = hf.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=24,
                               min_new_tokens=24, do_sample=False)[0, len(o.prompt_token_ids):]
        assert o.outputs[0].token_ids == want.tolist()


@pytest.mark.slow
def test_smollm2_greedy_tokens_pallas_interpret_equal_reference():
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(attention_impl="pallas", interpret=True, **ENGINE) as llm:
        assert llm.engine.runner.attention_impl == "pallas"
        pallas = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(attention_impl="reference", **ENGINE) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert pallas == reference


@pytest.mark.slow
def test_smollm2_default_cpu_attention_is_grouped_and_gives_the_reference_tokens():
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(**ENGINE) as llm:
        assert llm.engine.runner.attention_impl == "grouped"
        grouped = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(attention_impl="reference", **ENGINE) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert grouped == reference
