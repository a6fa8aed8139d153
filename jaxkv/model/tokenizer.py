"""Tokenizer: text <-> token ids and chat-template rendering, built from GGUF metadata or an HF dir.

Both builders produce one ``tokenizers.Tokenizer`` (Rust BPE) plus the few facts the engine needs
(bos/eos ids, the chat template). Chat templates are untrusted Jinja code from model files, so they
render in jinja2's immutable sandbox with the same helpers HF transformers offers
(``raise_exception``, ``strftime_now``, a non-HTML-escaping ``tojson``, ``loopcontrols``).
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

SUPPORTED_GGUF_TOKENIZER_MODELS = ("gpt2", "llama")
# ``tokenizer.ggml.model == "llama"`` (SentencePiece) is read for these architectures only: their
# files list no merges, which are rebuilt in the order the tokens appear (as transformers does).
_GGUF_SENTENCEPIECE_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# llama.cpp's pre-tokenizer regexes, by ``tokenizer.ggml.pre``.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's SMOLLM/STARCODER/REFACT: split "\p{N}" one digit at a time, then the GPT-2 regex.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


_GGUF_PRE_TOKENIZERS = {
    "default": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "smollm": _digits_then_gpt2_pre,
    "starcoder": _digits_then_gpt2_pre,
    "refact": _digits_then_gpt2_pre,
    "llama-bpe": functools.partial(_split_pre, _LLAMA3_SPLIT),
    "llama3": functools.partial(_split_pre, _LLAMA3_SPLIT),
    "smaug-bpe": functools.partial(_split_pre, _LLAMA3_SPLIT),
    "qwen2": functools.partial(_split_pre, _QWEN2_SPLIT),
}


def _gemma_spm_backend(tokens: list[str], unk: str) -> tuple[tokenizers.Tokenizer, list[str]]:
    """A Gemma SentencePiece vocabulary (GGUF ``llama`` model) as the byte-fallback BPE HF's
    GemmaTokenizer is: spaces become ``▁``; a token of only whitespace with a space is
    respelled as ``▁`` s (returned with the backend: the respelled tokens);
    the merges are every split of a token into two tokens, earliest token first (its longer
    left part first), as transformers rebuilds them (``gemma_tokenizer``)."""
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges += [(rank, left, right) for left, right in sorted(
            pairs, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))]
    merges.sort(key=lambda m: (m[0], -len(m[1]), -len(m[2])))
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=[(left, right) for _, left, right in merges], fuse_unk=True,
        unk_token=unk, byte_fallback=True))
    backend.normalizer = tokenizers.normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, tokens


@functools.cache
def _byte_alphabet() -> frozenset[str]:
    """The 256 printable characters GPT-2's byte-level BPE spells bytes with."""
    return frozenset(pre_tokenizers.ByteLevel.alphabet())


@functools.cache
def _char_to_byte() -> dict[str, int]:
    """GPT-2's byte-level spelling inverted: printable character -> the byte it stands for.

    Bytes that print (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) spell themselves; the other 68
    are shifted to code points 256.. in byte order (GPT-2's ``bytes_to_unicode``).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


@functools.cache
def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """Byte-level BPE tokenizer with the model's special tokens and chat template.

    Attributes:
      backend: the ``tokenizers.Tokenizer`` doing the work.
      bos_token_id: beginning-of-sequence id, or None.
      eos_token_ids: every id that ends generation (first one is the primary eos).
      chat_template: Jinja source of the chat template, or None.
      special_tokens: template variables such as ``{"bos_token": "<s>", "eos_token": "</s>"}``.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], chat_template: str | None,
                 special_tokens: dict[str, str]):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenizes ``text``.

        Args:
          text: the string.
          add_special_tokens: apply the model's post-processor (e.g. prepend BOS where the model
            asks for it). Special-token strings inside ``text`` are always matched whole.

        Returns:
          Token ids, a list of python ints.
        """
        # the batch call releases the GIL while it works (the single-text one holds it
        # throughout: a long text froze every other thread, a server's event loop included)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Turns ids (any int sequence or 1-D int array) back into text."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level token may be part of a UTF-8
        character); an added token whose spelling is not byte-level gives its UTF-8 text.

        Raises:
          ValueError: ``token_id`` is not in the vocabulary.
        """
        token = self.backend.id_to_token(int(token_id))
        if token is None:
            raise ValueError(f"token_id={token_id} is not in the vocabulary")
        table = _char_to_byte()
        if all(ch in table for ch in token):
            return bytes(table[ch] for ch in token)
        return token.encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        """Id of one vocabulary entry (spelled as in the vocabulary), or None."""
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs) -> str:
        """Renders a conversation with the model's chat template (sandboxed Jinja).

        Args:
          messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
          add_generation_prompt: end with the header that opens the assistant's turn.
          **kwargs: extra template variables (e.g. ``tools=[...]``).

        Returns:
          The prompt text; encode it with ``add_special_tokens=False`` (the template writes BOS
          itself where the model wants one).

        Raises:
          ValueError: the model has no chat template, or the template raised an error.
        """
        if self.chat_template is None:
            raise ValueError("this model's files carry no chat template "
                             "(tokenizer.chat_template / tokenizer_config.json chat_template)")
        variables = {**self.special_tokens, **kwargs}
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    @classmethod
    def from_gguf_metadata(cls, reader) -> "Tokenizer":
        """Builds the tokenizer a GGUF file describes in its ``tokenizer.*`` metadata.

        Args:
          reader: a ``gguf.GGUFReader``. Uses ``tokenizer.ggml.{model, pre, tokens, merges,
            token_type, bos_token_id, eos_token_id, eot_token_id, add_bos_token}`` and
            ``tokenizer.chat_template``.

        Raises:
          ValueError: missing fields, or a tokenizer model / pre-tokenizer we do not support
            (``llama``, SentencePiece, is read for Gemma files only).
        """
        from jaxkv.model.gguf import metadata_field

        def field(key: str, default: Any = KeyError):
            return metadata_field(reader, key, default)

        model = field("tokenizer.ggml.model")
        if model not in SUPPORTED_GGUF_TOKENIZER_MODELS:
            raise ValueError(
                f"{reader.data.filename}: tokenizer.ggml.model={model!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_GGUF_TOKENIZER_MODELS)}")
        arch = field("general.architecture", None)
        if model == "llama" and arch not in _GGUF_SENTENCEPIECE_ARCHITECTURES:
            raise ValueError(
                f"{reader.data.filename}: tokenizer.ggml.model='llama' (SentencePiece) is "
                f"supported for {', '.join(_GGUF_SENTENCEPIECE_ARCHITECTURES)} files only, not "
                f"general.architecture={arch!r}")
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise ValueError(
                f"{reader.data.filename}: tokenizer.ggml.pre={pre!r} is not supported; "
                f"supported: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))}")
        tokens = field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        token_types = field("tokenizer.ggml.token_type", [0] * len(tokens))

        if model == "llama":
            unk = field("tokenizer.ggml.unknown_token_id", None)
            backend, tokens = _gemma_spm_backend(tokens, "<unk>" if unk is None else tokens[unk])
            alphabet = None
        else:
            backend = tokenizers.Tokenizer(models.BPE(
                vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
            backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
            backend.decoder = decoders.ByteLevel()
            alphabet = _byte_alphabet()
        # Control tokens spelled outside the byte alphabet are llama.cpp mislabels (they could never
        # be produced by the BPE); like HF we leave them out.
        backend.add_special_tokens([
            tokenizers.AddedToken(t, normalized=False, special=True)
            for t, kind in zip(tokens, token_types)
            if kind == _GGUF_CONTROL and (alphabet is None or set(t) <= alphabet)])
        backend.add_tokens([
            tokenizers.AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types)
            if kind == _GGUF_USER_DEFINED and backend.token_to_id(t) is not None])

        bos = field("tokenizer.ggml.bos_token_id", None)
        eos_ids = tuple(dict.fromkeys(
            int(i) for i in (field("tokenizer.ggml.eos_token_id", None),
                             field("tokenizer.ggml.eot_token_id", None)) if i is not None))
        if bos is not None and field("tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                special_tokens=[(tokens[bos], int(bos))])
        special = {}
        if bos is not None:
            special["bos_token"] = tokens[bos]
        if eos_ids:
            special["eos_token"] = tokens[eos_ids[0]]
        return cls(backend, bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids,
                   chat_template=field("tokenizer.chat_template", None), special_tokens=special)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Builds the tokenizer of an HF model directory.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens, chat
        template), ``chat_template.jinja`` / ``chat_template.json`` (newer layouts) and
        ``generation_config.json`` (eos ids) when present.

        Raises:
          FileNotFoundError: ``tokenizer.json`` is missing.
          ValueError: a file is not valid JSON / not a tokenizer.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file}: not found (an HF model directory needs tokenizer.json; "
                "slow sentencepiece-only tokenizers are not supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust error type is not exported
            raise ValueError(f"{tok_file}: not a valid tokenizers file: {e}") from e
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value

        def token_id(name: str) -> int | None:
            return backend.token_to_id(special[name]) if name in special else None

        gen_eos = generation.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        eos_ids = tuple(dict.fromkeys(
            int(i) for i in [*gen_eos, token_id("eos_token")] if i is not None))
        bos = token_id("bos_token")
        if bos is None and generation.get("bos_token_id") is not None:
            bos = int(generation["bos_token_id"])
        return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids,
                   chat_template=_hf_chat_template(path, config), special_tokens=special)


def _read_json(file: Path) -> dict[str, Any]:
    """Contents of an optional JSON file ({} when absent)."""
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON: {e}") from e


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default chat template of an HF dir (``chat_template.jinja`` wins, as in transformers)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template",
                                                            config.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template
