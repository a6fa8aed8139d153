"""GGUF files of the families added after Llama/Qwen (issue 52): Gemma 2, Gemma 3, Mixtral,
Qwen3-MoE and gpt-oss, written from tiny random HF checkpoints the way llama.cpp's
``convert_hf_to_gguf.py`` writes them.

``write_gguf`` is an independent model of that converter: tensor names from the ``gguf``
package's own ``get_tensor_name_map`` (the table the converter uses), its metadata keys
(``gguf.GGUFWriter``'s ``add_*``), and its transformations: Gemma's norms stored as ``w + 1``,
Llama-arch (Mixtral) q/k rows permuted for interleaved RoPE, experts stacked ``[X, out, in]``,
gpt-oss's ``gate_up_proj`` split and transposed and its sinks named ``attn_sinks.weight``.

Each family is checked twice: jaxkv's reading of the GGUF equals its reading of the HF
directory (config and every tensor), and transformers' own GGUF reader
(``from_pretrained(gguf_file=)``) gives the same greedy tokens and logprobs as jaxkv's engine
on the GGUF. transformers reads no Mixtral GGUF (llama.cpp's ``llama`` arch with experts is
a dense Llama to it) and no llama.cpp gpt-oss GGUF (it looks for ``ffn_*_projs``); those two
are checked against the HF checkpoint only. Where transformers reads a GGUF but not one of
its keys (Gemma's soft-caps and ``query_pre_attn_scalar``, Qwen3-MoE's expert width), the
tiny configs use transformers' defaults, so both readers must agree on what the file says.
"""

import dataclasses
import json
import re
from collections import defaultdict

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxkv.model.weights import load_model_files  # noqa: E402
from tiny_models import (  # noqa: E402
    assert_greedy_equals_hf, austen_text, save_tiny_model, save_tokenizer)


@dataclasses.dataclass(frozen=True)
class Family:
    """A tiny checkpoint and how llama.cpp's converter writes it."""

    kind: str                       # HF model_type
    arch: str                       # general.architecture
    overrides: dict
    permute_qk: bool = False        # LlamaModel.permute
    norm_shift: float = 0.0         # Gemma: + 1
    transformers_reads: bool = True


FAMILIES = {f.kind: f for f in (
    # Gemma 2: sliding / full / sliding; transformers' defaults for what it does not read
    # (query_pre_attn_scalar 256 = head_dim, the key llama.cpp derives it from; caps 50 / 30)
    Family("gemma2", "gemma2", dict(num_hidden_layers=3, head_dim=256, sliding_window=16,
                                    query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0), norm_shift=1.0),
    # Gemma 3: 5 sliding : 1 full (+ 1), q/k norms, local RoPE base 1e4 (llama.cpp's constant)
    Family("gemma3_text", "gemma3", dict(num_hidden_layers=7, head_dim=256, sliding_window=16,
                                         query_pre_attn_scalar=256), norm_shift=1.0),
    # Mixtral: llama arch with experts, q/k permuted
    Family("mixtral", "llama", dict(num_local_experts=4, num_experts_per_tok=2),
           permute_qk=True, transformers_reads=False),
    # Qwen3-MoE: llama.cpp always renormalises the top-k; transformers' expert width 768
    Family("qwen3_moe", "qwen3moe", dict(num_hidden_layers=2, head_dim=32, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=768,
                                         norm_topk_prob=True)),
    # gpt-oss: sinks, biases, YaRN, sliding / full layers
    Family("gpt_oss", "gpt-oss", dict(num_hidden_layers=2, head_dim=24, sliding_window=16,
                                      intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2, rope_parameters=dict(
                                          rope_type="yarn", factor=4.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False,
                                          original_max_position_embeddings=64,
                                          rope_theta=150000.0)),
           transformers_reads=False),
)}


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf's LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _rope_theta(cfg):
    params = cfg.get("rope_parameters") or {}
    return params.get("full_attention", params).get("rope_theta", cfg.get("rope_theta"))


def write_metadata(w, cfg, family):
    """The keys the converter's ``set_gguf_parameters`` writes for these families."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if family.arch != "gemma2":                   # Gemma2Model writes no RoPE base
        w.add_rope_freq_base(_rope_theta(cfg))
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if family.arch == "llama":                    # LlamaModel
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or
                                   cfg["hidden_size"] // cfg["num_attention_heads"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size") or family.arch == "gpt-oss":
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or
                                         cfg["intermediate_size"])
    if family.arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if family.arch in ("gemma2", "gemma3", "gpt-oss"):
        w.add_sliding_window(cfg["sliding_window"])
    if family.arch == "gpt-oss":
        rope = cfg["rope_parameters"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def write_tokenizer(w, path):
    """The HF tokenizer.json's BPE as ``tokenizer.ggml.*`` (gpt2), ids as generation_config."""
    model = json.loads((path / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def gguf_tensors(tensors, cfg, family):
    """HF checkpoint tensors -> the converter's GGUF tensors (``modify_tensors`` + names)."""
    n = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(
        next(a for a, s in gguf.MODEL_ARCH_NAMES.items() if s == family.arch), n)

    def rename(hf):
        base, _, suffix = hf.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf, "weight"           # gpt-oss: sinks -> attn_sinks.weight
        return f"{names.get_name(base)}.{suffix}"

    out, stacked = {}, defaultdict(dict)
    for name, w in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:                                     # Mixtral / Qwen3-MoE: stack the experts
            stacked[f"{m[1]}.{m[3]}"][int(m[2])] = w
            continue
        if name.endswith("norm.weight"):
            w = w + np.float32(family.norm_shift)
        if family.permute_qk and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, cfg["num_attention_heads"])
        if family.permute_qk and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, cfg["num_key_value_heads"])
        if name.endswith("experts.down_proj"):    # gpt-oss: [X, F, E] -> [X, E, F]
            w = w.transpose(0, 2, 1)
        if name.endswith("experts.down_proj_bias"):
            name = name.replace("down_proj_bias", "down_proj.bias")
        if name.endswith("experts.gate_up_proj"):  # [X, E, 2F] -> gate, up [X, F, E]
            w = w.transpose(0, 2, 1)
            out[rename(name.replace("gate_up_proj", "gate_proj"))] = w[:, 0::2]
            out[rename(name.replace("gate_up_proj", "up_proj"))] = w[:, 1::2]
            continue
        if name.endswith("experts.gate_up_proj_bias"):
            out[rename(name.replace("gate_up_proj_bias", "gate_proj.bias"))] = w[:, 0::2]
            out[rename(name.replace("gate_up_proj_bias", "up_proj.bias"))] = w[:, 1::2]
            continue
        out[rename(name)] = w
    for base, experts in stacked.items():
        out[rename(base + ".weight")] = np.stack([experts[x] for x in sorted(experts)])
    return out


def write_gguf(hf_dir, family, out, qtypes=None):
    """``hf_dir``'s checkpoint as llama.cpp's converter writes it: F32 tensors, or those named
    ``blk.{i}.{part}.weight`` in ``qtypes[part]`` (quantized by the ``gguf`` package)."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), family.arch)
    write_metadata(w, cfg, family)
    write_tokenizer(w, hf_dir)
    tensors = gguf_tensors(load_file(hf_dir / "model.safetensors"), cfg, family)
    for name, t in sorted(tensors.items()):
        t = np.ascontiguousarray(t, dtype=np.float32)
        part = name.split(".")[2] if name.startswith("blk.") and name.endswith(".weight") else None
        qtype = (qtypes or {}).get(part)
        if qtype is None:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_files(request, tmp_path_factory):
    """(family, HF dir, GGUF path): a tiny random checkpoint, norms and biases off HF's init."""
    family = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tokenizer(path)
    model = save_tiny_model(path, family.kind, **family.overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return family, path, write_gguf(path, family, path / "model.gguf")


def _comparable(config):
    """A config with what a GGUF cannot say normalised: the expert width where it is the
    dense one, the special token ids (the tokenizer's, checked elsewhere), and the norm
    epsilon rounded to the float32 GGUF stores."""
    size = config.expert_size if config.num_experts else None
    return dataclasses.replace(config, moe_intermediate_size=size, bos_token_id=None,
                               eos_token_ids=(), rms_norm_eps=float(np.float32(
                                   config.rms_norm_eps)))


def test_gguf_equals_hf_checkpoint(family_files):
    """jaxkv reads the converter's GGUF as the HF directory it came from."""
    family, path, gguf_path = family_files
    ours, hf = load_model_files(gguf_path), load_model_files(path)
    assert ours.config.architecture == family.kind
    assert _comparable(ours.config) == _comparable(hf.config)
    assert set(ours.tensors) == set(hf.tensors)
    for k, want in hf.tensors.items():     # norms: (w + 1) - 1 in float32
        np.testing.assert_allclose(ours.tensors[k], want, atol=1e-6, rtol=0, err_msg=k)


NEW_TOKENS = 8
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64,
              block_size=8, num_kv_blocks=120, token_buckets=(64,), seq_buckets=(2,))


@pytest.mark.parametrize("family_files", [k for k, f in FAMILIES.items() if f.transformers_reads],
                         indirect=True)
def test_transformers_gguf_reader_equals_jaxkv(family_files):
    """transformers' GGUF reader (the independent oracle of llama.cpp's conventions) and
    jaxkv's engine on the same GGUF: greedy tokens and their logprobs (fp32). Not for Mixtral
    (transformers reads its GGUF as a dense Llama without the experts) and gpt-oss (it cannot
    read that GGUF): those are checked against their HF checkpoints only."""
    import transformers

    family, path, gguf_path = family_files
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    assert hf.config.model_type == family.kind
    prompt = transformers.AutoTokenizer.from_pretrained(path)(austen_text(2000)).input_ids[:40]
    assert_greedy_equals_hf(gguf_path, hf, prompt, NEW_TOKENS, **ENGINE)
