"""Each architecture through the engine against HF transformers (fp32, CPU): greedy tokens and
per-token logprobs of 64 generated tokens, through chunked prefill, continuous batching with
other requests, prefix-cache hits and preemption, on tiny random checkpoints written by
transformers with shapes that reach each architecture's edge cases."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv import LLM, SamplingParams  # noqa: E402
from tiny_models import austen_text, hf_reference, save_tiny_model, save_tokenizer  # noqa: E402

# per architecture: transformers' config fields beyond tiny_models' defaults (64 wide, 2
# layers, 4 q / 2 kv heads)
ARCHITECTURES = {
    # q/k norms per head; head_dim 32 != hidden / heads (16), as Qwen3-0.6B's 128 != 64
    "qwen3": dict(head_dim=32),
    # sliding (window 16: prompts run several blocks past it) and full layers, soft-caps
    "gemma2": dict(num_hidden_layers=3, head_dim=32, sliding_window=16,
                   query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=8.0),
    # 5 sliding : 1 full (+ 1), q/k norms, local RoPE base 1e4, linearly scaled global
    "gemma3_text": dict(num_hidden_layers=7, head_dim=32, sliding_window=16,
                        query_pre_attn_scalar=24, rope_parameters=dict(
                            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                            sliding_attention=dict(rope_type="default", rope_theta=1e4))),
    # 8 experts, top 2 (more experts than a decode step's tokens use), renormalised
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    # a dense layer among the MoE ones, top 3 of 6 not renormalised, Qwen3's attention
    "qwen3_moe": dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
                      moe_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False),
    # sliding / full / sliding with learned sinks, biases everywhere, top 2 of 6 experts with
    # the clamped SwiGLU, head_dim 24 (not a power of two), YaRN past a 64-token original
    # context
    "gpt_oss": dict(num_hidden_layers=3, head_dim=24, sliding_window=16, intermediate_size=48,
                    num_local_experts=6, num_experts_per_tok=2, rope_parameters=dict(
                        rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                        truncate=False, original_max_position_embeddings=64,
                        rope_theta=150000.0)),
}
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
              token_buckets=(8, 32), seq_buckets=(4,), prefix_caching="hash",
              num_kv_blocks=40)     # 39 usable blocks of 8: the four requests (84-214 tokens) do not fit
NEW_TOKENS = 64
# a hybrid cache's blocks hold one layer slot (jaxkv/config/kv_groups.py), and each sequence a
# table per group: Gemma 2's 3 groups hold 32 + 2 x 7 blocks for 256 tokens, Gemma 3's 7 hold
# 32 + 6 x 7; these pools fit one such sequence, not the four requests at once
POOL_BLOCKS = {"gemma2": 56, "gemma3_text": 84, "gpt_oss": 56}
# whole blocks of the shared 96 tokens two requests find; a sliding group's blocks leave its
# window (and turn LRU) long before the request ends, so in these tight pools one of the two
# requests finds only part of the prefix
MIN_HITS = {"gemma2": 88, "gemma3_text": 64, "gpt_oss": 88}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tokenizer(path)
    model = save_tiny_model(path, request.param, **ARCHITECTURES[request.param])
    with torch.no_grad():    # norm weights away from HF's init (ones), so each is checked
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(("bias", "sinks")):    # HF starts gpt-oss's at 0
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None    # plain argmax, as ignore_eos
    return request.param, path, model


def test_engine_equals_transformers(checkpoint):
    """Four requests, two of them sharing a 96-token prefix with a finished one (prefix hits),
    prompts longer than a step's 32 tokens (chunked prefill), batched together in a pool too
    small for all of them (preemption): every request's tokens and logprobs are HF's."""
    arch, path, model = checkpoint
    text = austen_text(8000)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    engine = ENGINE | dict(num_kv_blocks=POOL_BLOCKS.get(arch, ENGINE["num_kv_blocks"]))
    with LLM(str(path), **engine) as llm:
        ids = llm.tokenizer.encode(text)
        shared = ids[:96]
        prompts = [shared + ids[200:240], ids[300:450], shared + ids[500:530], ids[600:620]]
        first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
        outs = first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params,
                                    use_tqdm=False)
        stats = llm.stats()
    assert stats["prefix_cache_hits"] >= MIN_HITS.get(arch, 2 * 88), stats
    assert stats["num_preemptions"] > 0, stats
    for prompt, out in zip(prompts, outs):
        want_tokens, want_logprobs = hf_reference(model, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, arch
        logprobs = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kwargs,field", [
    (dict(kv_retention="h2o", kv_budget_tokens=64), "kv_retention='h2o'"),
    (dict(sparse_attention="quest", sparse_budget_tokens=64), "sparse_attention='quest'"),
])
def test_layer_kinds_refuse_retention_and_quest_naming_the_field(tmp_path, kwargs, field):
    """Gemma 2's sliding layers attend through the model's own window (their hybrid cache
    group keeps only it); a retention policy or Quest over them is refused before any weight
    loads."""
    save_tokenizer(tmp_path)
    save_tiny_model(tmp_path, "gemma2", **ARCHITECTURES["gemma2"])
    with pytest.raises(ValueError, match=f"{field}.*own sliding_window=16"):
        LLM(str(tmp_path), **ENGINE | dict(num_kv_blocks=POOL_BLOCKS["gemma2"]), **kwargs)
