"""A float64 numpy forward of a tiny HF Llama (weights from its transformers state dict) whose
attention is a callback, the independent oracle of the KV-retention and sparse-attention tests:

    logprobs = llama_logprobs(model, tokens, attend)   # [T, V]

``attend(t, q, k, v, rope)`` returns query ``t``'s attention output [H, D] from the layer's
pre-RoPE ``q`` [T, H, D] and ``k`` [T, Hkv, D] and its ``v`` [T, Hkv, D]; ``rope(x, positions)``
rotates with the model's RoPE (HF rotate-half), and ``attend_heads`` does the softmax for given
key sets. Each test states its policy (which keys, at which positions) in ``attend`` alone.
"""

import numpy as np


def _rotate(x, pos, theta):
    """HF rotate-half RoPE of x [..., D] at positions pos (broadcast over x's leading axes)."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = np.asarray(pos, np.float64)[..., None] * inv                   # [..., D/2]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attend_heads(q, k, v, keys):
    """Softmax attention of rotated q [H, D] over rotated k / v [n, Hkv, D] (GQA groups of
    H / Hkv heads), each kv head over ``keys`` (int indices into k), or one list per kv head."""
    H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    per_head = keys if isinstance(keys, list) else [keys] * Hkv
    out = np.zeros((H, D))
    for h in range(Hkv):
        s = q[h * G:(h + 1) * G] @ k[per_head[h], h].T / np.sqrt(D)     # [G, n]
        w = np.exp(s - s.max(-1, keepdims=True))
        out[h * G:(h + 1) * G] = (w / w.sum(-1, keepdims=True)) @ v[per_head[h], h]
    return out


def llama_logprobs(model, tokens, attend):
    """float64 log-softmax [T, V] of ``model`` on ``tokens`` with attention by ``attend``."""
    c = model.config
    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    H, Hkv = c.num_attention_heads, c.num_key_value_heads
    D = c.hidden_size // H
    theta = getattr(c, "rope_theta", 10000.0)

    def rope(x, pos):
        return _rotate(x, pos, theta)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * w

    T = len(tokens)
    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).reshape(T, H, D)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).reshape(T, Hkv, D)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).reshape(T, Hkv, D)
        out = np.stack([attend(t, q, k, v, rope) for t in range(T)])      # [T, H, D]
        x = x + out.reshape(T, H * D) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ sd[p + "mlp.up_proj.weight"].T)) \
            @ sd[p + "mlp.down_proj.weight"].T
    logits = rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
