"""The model files Dynamo registers: its frontend tokenizes, renders chat templates and
detokenizes from an HF-style directory (``tokenizer.json``, ``tokenizer_config.json``,
``config.json``, ``generation_config.json``).

An HF model directory is registered as it is; for a GGUF file (the store's models) the
directory is written from the tokenizer jaxkv built out of the file's metadata, so Dynamo's
token ids are exactly the engine's. Its path is the same for every worker of one model and
context (Dynamo's frontend rejects a worker whose model card, paths included, differs from the
first one's), under ``~/.cache/jaxkv/dynamo_cards`` (``$JAXKV_DYNAMO_CARDS_DIR``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

HF_FILES = ("tokenizer.json", "config.json")


def is_hf_dir(model_path: str | Path) -> bool:
    """Whether ``model_path`` is an HF directory Dynamo can register as it is."""
    path = Path(model_path)
    return path.is_dir() and all((path / f).is_file() for f in HF_FILES)


def card_path(model_path: str | Path, max_model_len: int | None) -> Path:
    """Where the files of ``model_path`` served with ``max_model_len`` (the flag; None: the
    engine's default) are written: one directory per (absolute path, context)."""
    root = Path(os.environ.get("JAXKV_DYNAMO_CARDS_DIR")
                or Path.home() / ".cache" / "jaxkv" / "dynamo_cards")
    key = f"{Path(model_path).resolve()}\0{max_model_len}".encode()
    return root / f"{Path(model_path).stem}-{hashlib.sha256(key).hexdigest()[:16]}"


def write_card(tokenizer, model_config, max_model_len: int, out_dir: str | Path) -> Path:
    """Writes the four files from a ``jaxkv.model.tokenizer.Tokenizer`` and a
    ``ModelConfig``; returns ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / "tokenizer.json", tokenizer.backend.to_str())
    eos = list(tokenizer.eos_token_ids)
    specials = dict(tokenizer.special_tokens)
    _write(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_model_len,
        "chat_template": tokenizer.chat_template,
        **{k: specials[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
           if specials.get(k)},
    })
    _write(out / "config.json", {
        "model_type": model_config.architecture,
        "architectures": [hf_class(model_config.architecture)],
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.hidden_size,
        "num_hidden_layers": model_config.num_layers,
        "num_attention_heads": model_config.num_heads,
        "num_key_value_heads": model_config.num_kv_heads,
        "max_position_embeddings": max_model_len,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    })
    _write(out / "generation_config.json", {"bos_token_id": tokenizer.bos_token_id,
                                            "eos_token_id": eos})
    return out


def hf_class(model_type: str) -> str:
    """HF's causal-LM class name of a ``model_type`` (``qwen3_moe`` -> ``Qwen3MoeForCausalLM``)."""
    return "".join(part.capitalize() for part in model_type.split("_")) + "ForCausalLM"


def _write(path: Path, body: dict) -> None:
    _replace(path, json.dumps({k: v for k, v in body.items() if v is not None}, indent=2))


def _replace(path: Path, text: str) -> None:
    """Writes ``path`` whole or not at all (workers starting together write the same files)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
