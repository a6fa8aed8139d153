"""Greedy decoding on SmolLM2-135M with quantized KV caches against the fp32 cache:
free-running, fp8 / int8 first differ only at near ties (3 prompts x 32 tokens); teacher-forced agreement along the fp32 continuation (fp8, int8, KIVI int4 / int2)."""

import pytest

from jaxkv import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              num_kv_blocks=64, token_buckets=(16, 64), seq_buckets=(4,))
PROMPTS = ["It is a truth universally acknowledged, that a single man in possession",
           "The capital of France is", "Emma Woodhouse, handsome, clever, and rich,"]
# Free-running, one near-tie flip makes the rest of a 32-token continuation differ, so the test
# is about the first difference of each sequence: there the fp32 cache's top-2 logprob margin
# must be small (a near tie) and the quantized cache must have picked fp32's runner-up.
# Measured on this CPU (fp32 margins at the first differences; 2 of the 3 sequences differ in
# each): int8 0.018 and 0.17 nats, fp8_e4m3 0.018 and 0.24; the bound a little above.
NEAR_TIE = {"fp8_e4m3": 0.5, "int8": 0.5}


def greedy(kv):
    """Greedy continuations of ``PROMPTS`` with a ``kv`` cache: (token ids, top-2 logprobs)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    with LLM(kv_cache_dtype=kv, **ENGINE) as llm:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow
def test_smollm2_fp8_and_int8_cache_agree_with_fp32():
    ref = greedy("fp32")
    for kv, bound in NEAR_TIE.items():
        for (got, _), (want, logprobs) in zip(greedy(kv), ref):
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if first is None:
                continue
            top = sorted(logprobs[first].items(), key=lambda t: -t[1])
            margin = top[0][1] - top[1][1]
            assert got[first] == top[1][0] and margin < bound, (kv, first, margin)


# teacher-forced (each step decodes the fp32 continuation, so one near-tie flip does not change
# every later context): measured on this CPU over 96 steps after a 128-token Austen prompt
# fp8_e4m3 0.969, int8 0.990, int4 KIVI (window 8 blocks) 0.990, int2 KIVI 0.854; floors a
# little below
TEACHER_FORCED_FLOOR = {"fp8_e4m3": (0.93, {}), "int8": (0.95, {}),
                        "int4": (0.95, dict(residual_blocks=8)),
                        "int2": (0.75, dict(residual_blocks=8))}


@pytest.mark.slow
def test_smollm2_teacher_forced_agreement_with_fp32_cache():
    from jaxkv.entrypoints.eval import token_agreement
    from tiny_models import austen_text

    with LLM(kv_cache_dtype="fp32", **ENGINE) as llm:
        prompt = llm.tokenizer.encode(austen_text(4_000, "pride_and_prejudice.txt"))[:128]
        ref = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=96, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        got = {kv: token_agreement(llm.engine.runner, prompt, ref, kv_cache_dtype=kv, prefill_chunk=64, **opts)
               for kv, (_, opts) in TEACHER_FORCED_FLOOR.items()}
    print({kv: r.agreement for kv, r in got.items()})
    for kv, (floor, _) in TEACHER_FORCED_FLOOR.items():
        assert got[kv].agreement >= floor, (kv, got[kv].agreement)
    assert got["int2"].agreement < got["int8"].agreement
