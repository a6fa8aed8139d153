"""compressed-tensors checkpoints kept quantized (jaxkv/model/compressed_tensors.py).

A tiny Llama's Linears are compressed by the compressed-tensors package's own compressors
(scales by the min-max formula below) and written as llm-compressor writes them; the oracle is
HF transformers loading the same directory (its compressed-tensors quantizer decompresses, in
float32): greedy tokens and logprobs through the engine, and the dequantized weights bit for
bit (bf16 scales). Without the package, a numpy packer and decoder written here check the
layouts.
"""

import json
import re

import ml_dtypes
import numpy as np
import pytest
from tiny_models import assert_greedy_equals_hf, save_tiny_model, save_tokenizer

from jaxkv.model import compressed_tensors as ct
from jaxkv.model.quantized import QuantizedWeight, dequantize_numpy
from jaxkv.model.weights import load_config, load_model_files, stored_weights_bytes

# preset: (format, weights args, the qtype kept)
PRESETS = {
    "W4A16": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                     group_size=32), "Q4_0"),
    "W4A16_ASYM": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False,
                                          strategy="group", group_size=64), "Q4_1"),
    "W8A16": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
              "Q8_0"),
    "W8A8_INT": ("int-quantized", dict(num_bits=8, type="int", symmetric=True,
                                       strategy="channel"), "Q8_0"),
    "FP8": ("float-quantized", dict(num_bits=8, type="float", symmetric=True,
                                    strategy="channel"), "F8_E4M3"),
    "FP8_TENSOR": ("float-quantized", dict(num_bits=8, type="float", symmetric=True,
                                           strategy="tensor"), "F8_E4M3"),
    "FP8_BLOCK": ("float-quantized", dict(num_bits=8, type="float", symmetric=True,
                                          strategy="block", block_structure=[128, 128]),
                  "F8_E4M3"),
}
ENGINE_PRESETS = ["W4A16", "W4A16_ASYM", "W8A16", "FP8", "FP8_BLOCK"]
TINY = dict(hidden_size=128, intermediate_size=256)       # K of 128 and 256: 128-wide blocks
ENGINE = dict(max_model_len=128, num_gpu_blocks_override=16, max_num_seqs=2)
TOP = {4: 7.0, 8: 127.0}                                   # int codes' largest magnitude


def _tiles(w, args):
    """(tile rows, tile cols) of the strategy's scales over w [O, I]."""
    return {"tensor": w.shape, "channel": (1, w.shape[1]), "group": (1, args.get("group_size")),
            "block": tuple(args.get("block_structure") or (0, 0))}[args["strategy"]]


def _minmax(w, rows, cols):
    """float32 (min, max) of each [rows, cols] tile of w [O, I] (the last ones partial)."""
    o, i = w.shape
    lo = [[w[r:r + rows, c:c + cols].min() for c in range(0, i, cols)] for r in range(0, o, rows)]
    hi = [[w[r:r + rows, c:c + cols].max() for c in range(0, i, cols)] for r in range(0, o, rows)]
    return np.array(lo, np.float32), np.array(hi, np.float32)


def reference_scales(w, args):
    """llm-compressor's min-max observer in short: symmetric scale = max|w| / top, else
    (max - min) / 15 with zero = round(-min / scale) - 8, over each tile; scales bf16 (the
    asymmetric ones to 7 bits: the general case is ``test_numpy_packing_decodes_...``'s)."""
    lo, hi = _minmax(w, *_tiles(w, args))
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    top = 448.0 if args["type"] == "float" else TOP[args["num_bits"]]
    if args["symmetric"]:
        scale, zero = np.maximum(np.maximum(-lo, hi) / top, 1e-8), None
    else:        # 7 significant bits: -(zero + 8) * scale, Q4_1's minimum, is an f16 (exact)
        scale = np.maximum((hi - lo) / 15, 1e-8).astype(ml_dtypes.bfloat16)
        scale = (scale.view(np.uint16) & np.uint16(0xFFFE)).view(ml_dtypes.bfloat16)
    scale = scale.astype(ml_dtypes.bfloat16)
    if not args["symmetric"]:
        zero = np.clip(np.rint(-lo / scale.astype(np.float32)) - 8, -8, 7).astype(np.int8)
    if args["strategy"] == "tensor":
        scale = scale.reshape(1)
    return scale, zero


def _compressor(preset):
    """(the package's compressor of the preset's format, its scheme)."""
    cq = pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors is "
                             "not installed (pip install compressed-tensors)")
    from compressed_tensors.compressors import BaseCompressor

    fmt, args, _ = PRESETS[preset]
    scheme = cq.QuantizationScheme(targets=["Linear"], weights=cq.QuantizationArgs(**args),
                                   format=fmt)
    return BaseCompressor.load_from_registry(fmt), scheme


def write_compressed(path, preset, seed=0, kind="llama", **shape):
    """A tiny model of ``kind`` (a Llama of ``TINY`` by default; and tokenizer) at ``path``
    whose Linears as stored (each expert's of an MoE) but lm_head and the router are compressed
    by the compressed-tensors package as ``PRESETS[preset]`` (llm-compressor's MoE recipes
    ignore the router); returns the dense torch model."""
    compressor, scheme = _compressor(preset)
    import torch
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    save_tokenizer(path)
    model = save_tiny_model(path, kind, seed=seed, **(shape or TINY))
    tensors = load_file(path / "model.safetensors")
    linears = [k[:-len(".weight")] for k, v in tensors.items() if v.ndim == 2 and not re.search(
        r"embed_tokens|lm_head|norm|\.gate\.weight$", k)]
    for name in linears:
        w = tensors.pop(f"{name}.weight")
        scale, zero = reference_scales(w.numpy(), PRESETS[preset][1])
        parts = {"weight": w, "weight_scale": torch.from_numpy(scale.view(np.int16)).view(
            torch.bfloat16)}
        if zero is not None:
            parts["weight_zero_point"] = torch.from_numpy(zero)
        tensors |= {f"{name}.{k}": v.contiguous()
                    for k, v in compressor.compress(parts, scheme).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=PRESETS[preset][0],
                            ignore=["lm_head", r"re:.*\.gate$"], quantization_status="compressed")
    qc = {**qc.model_dump(mode="json"), "quant_method": ct.METHOD}
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return model


def package_weights(path, preset):
    """{P.weight: float32 [O, I]} of each compressed Linear P of ``path`` as compressed-tensors
    decompresses it, its scales in float32 (exact; transformers' float32 model does the same)."""
    from safetensors.torch import load_file

    compressor, scheme = _compressor(preset)
    stored = load_file(path / "model.safetensors")
    out = {}
    for prefix in {k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")}:
        parts = {k.rsplit(".", 1)[1]: v for k, v in stored.items()
                 if k.rsplit(".", 1)[0] == prefix}
        parts["weight_scale"] = parts["weight_scale"].float()
        out[f"{prefix}.weight"] = compressor.decompress(parts, scheme)["weight"].numpy()
    return out


def hf_oracle(path, preset, dense):
    """transformers' float32 model of ``path``: its compressed-tensors quantizer decompresses
    on the first forward. An asymmetric preset's packed zero points it registers at their
    unpacked shape (transformers 5.25, compressed-tensors 0.20.1: a size mismatch), and
    ``dequantize=True`` decompresses in bf16, so there the oracle is the ``dense`` model holding
    ``package_weights``."""
    import torch
    import transformers

    if PRESETS[preset][1]["symmetric"]:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            hf(torch.tensor([[1, 2]]))                     # decompressed here
        return hf
    with torch.no_grad():
        for name, w in package_weights(path, preset).items():
            dense.get_parameter(name).copy_(torch.from_numpy(w))
    return dense


@pytest.fixture(scope="module", params=list(PRESETS))
def checkpoint(request, tmp_path_factory):
    """(preset, directory, the transformers oracle, ``package_weights``)."""
    path = tmp_path_factory.mktemp(request.param.lower())
    dense = write_compressed(path, request.param)
    return request.param, path, hf_oracle(path, request.param, dense), package_weights(
        path, request.param)


def test_dequantized_weights_equal_the_package_decompression(checkpoint):
    """Kept: the dense projections in the preset's qtype, the rest float; dequantized (as
    ``quantization='none'`` loads them), they equal compressed-tensors' decompression bit for
    bit, as transformers' weights do; the planner counts the bytes held."""
    preset, path, hf, theirs = checkpoint
    kept = load_model_files(path, keep_quantized=True).tensors
    floats = load_model_files(path).tensors
    qweights = {k: w for k, w in kept.items() if isinstance(w, QuantizedWeight)}
    assert len(qweights) == len(theirs) == 14
    assert {w.qtype for w in qweights.values()} == {PRESETS[preset][2]}
    hf_weights = {k: v.numpy() for k, v in hf.state_dict().items()}
    for name, w in qweights.items():
        ours = dequantize_numpy(w)
        np.testing.assert_array_equal(floats[name], ours)
        np.testing.assert_array_equal(hf_weights[name], theirs[name])
        np.testing.assert_array_equal(ours, theirs[name], err_msg=name)
    held = sum(int(w.nbytes) for w in kept.values())
    assert stored_weights_bytes(path, load_config(path), 4)[0] == held


@pytest.mark.parametrize("checkpoint", ENGINE_PRESETS, indirect=True)
def test_engine_equals_transformers(checkpoint):
    _, path, hf, _ = checkpoint
    assert_greedy_equals_hf(path, hf, list(range(3, 40)), 24, **ENGINE)


def test_quantization_none_loads_floats():
    from jaxkv.config import EngineConfig
    from jaxkv.runner.model_runner import keeps_quantized

    assert keeps_quantized(EngineConfig.from_kwargs(model="m"))
    assert not keeps_quantized(EngineConfig.from_kwargs(model="m", quantization="none"))


def pack_int32(v, bits, dim=1):
    """compressed-tensors' packing written here: ``v + 2 ** (bits - 1)``, element i at bit
    i * bits of its row's stream (``dim`` 0: of its column's), little-endian."""
    v = np.asarray(v, np.int64).T if dim == 0 else np.asarray(v, np.int64)
    u = (v + (1 << (bits - 1))).astype(np.uint64)
    words = np.zeros((len(v), -(-v.shape[1] * bits // 32)), np.uint64)
    for i in range(v.shape[1]):
        words[:, i * bits // 32] |= u[:, i] << np.uint64(i * bits % 32)
    out = words.astype(np.uint32).view(np.int32)
    return out.T.copy() if dim == 0 else out


@pytest.mark.parametrize("bits,symmetric,group,qtype", [
    (4, True, 64, "Q4_0"), (4, False, 64, "Q4_1"), (8, True, None, "Q8_0")])
def test_numpy_packing_decodes_by_the_formula(bits, symmetric, group, qtype):
    """No package needed: codes packed here (K = 160: groups of 64 end partial; bf16 scales)
    decode as (q - zero) * scale, element by element: exactly, or for Q4_1 within half an
    f16 step of its minimum -(zero + 8) * scale (rounded to f16)."""
    rng = np.random.default_rng(bits)
    n, k, p = 40, 160, "model.layers.0.mlp.up_proj"
    groups = -(-k // (group or k))
    q = rng.integers(-(1 << bits - 1), 1 << bits - 1, (n, k))
    zero = rng.integers(-8, 8, (n, groups)) * (not symmetric)
    scale = (rng.random((n, groups)) * 0.1).astype(ml_dtypes.bfloat16).astype(np.float32)
    tensors = {f"{p}.weight_packed": pack_int32(q, bits), f"{p}.weight_shape": np.array([n, k]),
               f"{p}.weight_scale": scale, f"{p}.weight_zero_point": pack_int32(zero, bits, 0)}
    qc = {"format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": bits, "type": "int", "symmetric": symmetric, "group_size": group,
        "strategy": "group" if group else "channel"}}}}
    w = ct.convert(tensors, {}, qc, "config.json", keep_quantized=True)[f"{p}.weight"]
    assert (w.qtype, w.shape, w.group) == (qtype, (n, k), group or k)
    cols = np.arange(k) // (group or k)
    want = (q - zero[:, cols]) * scale[:, cols]
    slack = 0 if symmetric else np.spacing(np.abs(w.m)).astype(np.float32)[:, cols] / 2 + \
        np.spacing(np.abs(want).astype(np.float32))
    assert np.all(np.abs(dequantize_numpy(w) - want) <= slack)


def test_numpy_packing_is_the_packages():
    torch = pytest.importorskip("torch")
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers",
                                  reason="compressed-tensors is not installed")
    q = np.random.default_rng(1).integers(-8, 8, (24, 64)).astype(np.int8)
    for bits, dim in [(4, 1), (4, 0), (8, 1)]:
        theirs = helpers.pack_to_int32(torch.from_numpy(q), bits, packed_dim=dim).numpy()
        np.testing.assert_array_equal(pack_int32(q, bits, dim), theirs)


def _config(**weights):
    base = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    return {"format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {**base, **weights}}}}


@pytest.mark.parametrize("qc,field", [
    ({**_config(), "format": "nvfp4-pack-quantized"}, "quantization_config.format="),
    (_config(num_bits=3), r"group_0\.weights\.num_bits=3"),
    ({**_config(type="float", num_bits=4), "format": "naive-quantized"},
     r"group_0\.weights\.num_bits=4"),
    ({**_config(), "format": "float-quantized"}, r"weights\.type='int' is not stored float-q"),
    (_config(strategy="token"), r"group_0\.weights\.strategy='token'"),
    (_config(group_size=48), r"group_0\.weights\.group_size=48"),
    (_config(actorder="group"), r"group_0\.weights\.actorder='group'"),
    (_config(num_bits=8, symmetric=False), r"group_0\.weights\.symmetric=False"),
    (_config(strategy="block", block_structure=[128, 100]), r"weights\.block_structure"),
    ({**_config(), "kv_cache_scheme": {"num_bits": 8}}, "quantization_config.kv_cache_scheme"),
])
def test_bad_configs_name_the_field_and_file(qc, field):
    with pytest.raises(ValueError, match=f"^cfg/config.json: .*{field}"):
        ct.read_config(qc, "cfg/config.json")


def test_activation_quantization_warns_and_runs_weight_only():
    """FP8's static activation scales are dropped; the weights load as ever."""
    qc = {"format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "tensor"}, "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}
    codes = np.arange(64, dtype=np.float32).reshape(2, 32).astype(ml_dtypes.float8_e4m3fn)
    tensors = {"m.weight": codes, "m.weight_scale": np.array([0.5], np.float32),
               "m.input_scale": np.array([0.1], np.float32)}
    with pytest.warns(UserWarning, match="c.json: .*runs activations in float"):
        out = ct.convert(tensors, {}, qc, "c.json", keep_quantized=False)
    assert list(out) == ["m.weight"]
    np.testing.assert_array_equal(out["m.weight"], codes.astype(np.float32) * 0.5)


@pytest.mark.parametrize("scale", [7e4, 1e-9])
def test_a_scale_beyond_float16_names_the_tensor_and_file(scale):
    tensors = {"m.weight": np.ones((2, 32), ml_dtypes.float8_e4m3fn),
               "m.weight_scale": np.array([[1.0], [scale]], np.float32)}
    qc = {"format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}}
    with pytest.raises(ValueError, match=rf"^s\.safetensors: tensor m\.weight_scale holds "
                                         rf"{scale:g}, outside float16's range"):
        ct.convert(tensors, {"m.weight_scale": "s.safetensors"}, qc, "c.json", False)
