"""DeepSeek-V2/V3 checkpoints' HF tensor names and shapes (host-only, no jax: the loader's check
and the planner's parameter count read them; jaxkv/model/deepseek.py maps them to params)."""

from __future__ import annotations

import re

from jaxkv.model.config import ModelConfig

# what every tensor-parallel device holds whole: the norms, the down-projections whose outputs
# (the q latent, the kv latent and k_rope) feed every head, and the router (jaxkv.runner.sharding)
_REPLICATED = re.compile(r"norm\.|q_a_proj\.|kv_a_proj_with_mqa\.|mlp\.gate\.")


def replicated(name: str) -> bool:
    """Whether HF tensor ``name`` of a DeepSeek checkpoint is whole on every tp device (the
    rest split 1/tp ways: query heads, ``kv_b_proj``, ``o_proj``, MLPs, experts, vocab)."""
    return bool(_REPLICATED.search(name))


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes a DeepSeek checkpoint of ``c`` holds (``weights.
    expected_shapes`` for an MLA model): embeddings, final norm and head as every model's; per
    layer the norms, MLA's projections (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/
    ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), and
    the dense MLP or the router (V3: its bias), experts and shared experts."""
    m, E, N, V = c.mla, c.hidden_size, c.num_heads, c.vocab_size
    Dq, F = m.qk_nope_head_dim + m.qk_rope_head_dim, c.expert_size
    out = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (V, E)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out |= {p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
                a + "kv_a_proj_with_mqa.weight": (m.latent_dim, E),
                a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
                a + "kv_b_proj.weight": (N * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                a + "o_proj.weight": (E, N * m.v_head_dim)}
        if m.q_lora_rank:
            out |= {a + "q_a_proj.weight": (m.q_lora_rank, E),
                    a + "q_a_layernorm.weight": (m.q_lora_rank,),
                    a + "q_b_proj.weight": (N * Dq, m.q_lora_rank)}
        else:
            out[a + "q_proj.weight"] = (N * Dq, E)
        mlps = [(p + "mlp.", c.intermediate_size)]
        if c.is_moe_layer(i):
            mlps = [(p + "mlp.shared_experts.", F * c.num_shared_experts)] * bool(
                c.num_shared_experts)
            out[p + "mlp.gate.weight"] = (c.num_experts, E)
            if c.router_scoring == "sigmoid":
                out[p + "mlp.gate.e_score_correction_bias"] = (c.num_experts,)
            mlps += [(p + f"mlp.experts.{x}.", F) for x in range(c.num_experts)]
        for q, f in mlps:
            out |= {q + "gate_proj.weight": (f, E), q + "up_proj.weight": (f, E),
                    q + "down_proj.weight": (E, f)}
    return out
