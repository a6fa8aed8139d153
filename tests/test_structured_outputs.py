"""Structured outputs through the engine with xgrammar (issue 54): JSON schemas, regexes,
choices and EBNF grammars on a tiny random Llama, sampled at temperature 0.8 with n = 3, every
output valid (``jsonschema`` validates, ``re.fullmatch``), ending with ``finish_reason="stop"``;
greedy outputs identical with n-gram speculation and after preemption; the device bitmask
equal to xgrammar's own ``apply_token_bitmask_inplace``; bad specs refused naming the field
before anything is queued."""

import json
import re

import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")

from jaxkv import LLM, SamplingParams  # noqa: E402
from jaxkv.sample import logit_controls  # noqa: E402
from jaxkv.sample.structured import StructuredOutputsParams as Spec  # noqa: E402
from tiny_models import TINY_ENGINE  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"enum": ["red", "green", "blue"]}}}}
NESTED = {"type": "object", "additionalProperties": False, "required": ["point", "kind"],
          "properties": {"point": {"type": "object", "additionalProperties": False,
                                   "required": ["x", "y"],
                                   "properties": {"x": {"type": "integer", "maximum": 9,
                                                        "minimum": -9},
                                                  "y": {"type": "boolean"}}},
                         "kind": {"anyOf": [{"type": "null"},
                                            {"enum": ["a", "b"]}]}}}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
CHOICES = ["yes", "no", "it depends"]
GRAMMAR = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
PROMPTS = ["Emma was", "The weather in Highbury", "Mr. Knightley said"]


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny[0]), **TINY_ENGINE) as llm:
        yield llm


def _generate(llm, spec, n=3, temperature=0.8, max_tokens=64, **kw):
    params = SamplingParams(n=n, temperature=temperature, seed=7, max_tokens=max_tokens,
                            structured_outputs=spec, **kw)
    return [c for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]


@pytest.mark.parametrize("schema", [PERSON, NESTED], ids=["person", "nested"])
def test_json_schema_outputs_are_valid(llm, schema):
    """Compact JSON (a random model under xgrammar's default "any whitespace" writes
    whitespace until max_tokens, as it may under vLLM)."""
    outs = _generate(llm, Spec(json=schema, disable_any_whitespace=True))
    assert len(outs) == 9 and all(c.finish_reason == "stop" for c in outs)
    for c in outs:
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in outs}) > 1   # sampled, not one forced string


def test_json_object_regex_choice_and_grammar_outputs_match(llm):
    for c in _generate(llm, Spec(json_object=True, disable_any_whitespace=True),
                       max_tokens=128):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    for pattern in (DATE, EMAIL):
        outs = _generate(llm, Spec(regex=pattern))
        assert all(c.finish_reason == "stop" and re.fullmatch(pattern, c.text) for c in outs)
    outs = _generate(llm, Spec(choice=CHOICES))
    assert all(c.finish_reason == "stop" and c.text in CHOICES for c in outs)
    outs = _generate(llm, Spec(grammar=GRAMMAR), max_tokens=32)
    assert all(re.fullmatch(r"\(\d\d?( \+ \d\d?)*\)", c.text) for c in outs
               if c.finish_reason == "stop")
    assert any(c.finish_reason == "stop" for c in outs)


def test_greedy_is_identical_with_ngram_speculation_and_after_preemption(tiny, llm):
    """The same greedy outputs with drafts verified under the grammar's per-position masks,
    and from a pool so small that requests are preempted and recomputed."""
    spec = Spec(json=PERSON, disable_any_whitespace=True)
    want = [c.text for c in _generate(llm, spec, n=1, temperature=0)]
    kw = dict(TINY_ENGINE)
    with LLM(str(tiny[0]), **kw, speculative="ngram", num_speculative_tokens=3,
             speculative_adaptive=False) as spec_llm:
        assert [c.text for c in _generate(spec_llm, spec, n=1, temperature=0)] == want
        assert spec_llm.stats()["spec_num_draft_tokens"] > 0
    with LLM(str(tiny[0]), **{**kw, "num_kv_blocks": 14, "max_model_len": 96}) as small:
        assert [c.text for c in _generate(small, spec, n=1, temperature=0)] == want
        assert small.stats()["num_preemptions"] > 0


def test_device_bitmask_equals_xgrammars_own():
    rng = np.random.default_rng(0)
    vocab = 333
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    masks = rng.integers(-2 ** 31, 2 ** 31, size=(4, (vocab + 31) // 32), dtype=np.int64)
    masks = masks.astype(np.int32)
    want = torch.tensor(logits)
    xgr.apply_token_bitmask_inplace(want, torch.tensor(masks), vocab_size=vocab)
    got = logit_controls.apply(logits, np.zeros((4, 0), np.int32), np.zeros((4, 0), np.float32),
                               masks)
    np.testing.assert_array_equal(np.asarray(got), want.numpy())


@pytest.mark.parametrize("kw,field", [
    (dict(), "structured_outputs: give exactly one"),
    (dict(regex="a", choice=["b"]), "structured_outputs: give exactly one"),
    (dict(choice=[]), r"structured_outputs.choice=\[\]"),
    (dict(json="{not json"), "structured_outputs.json: not a JSON schema"),
    (dict(regex=5), "structured_outputs.regex"),
])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        Spec(**kw)


@pytest.mark.parametrize("spec,field", [
    (Spec(json={"type": "frob"}), "structured_outputs.json: cannot be compiled"),
    (Spec(regex="(ab"), "structured_outputs.regex: cannot be compiled"),
    (Spec(grammar="root ::= "), "structured_outputs.grammar: cannot be compiled"),
])
def test_uncompilable_specs_are_refused_before_queueing(llm, spec, field):
    with pytest.raises(ValueError, match=field):
        llm.generate("Emma", SamplingParams(max_tokens=4, structured_outputs=spec),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert _generate(llm, Spec(choice=CHOICES), n=1)[0].text in CHOICES   # still serving


# ------------------------------------------------- the default model behind `jaxkv serve`

REAL_FLAGS = ("--max-model-len", "1024", "--num-kv-blocks", "1200", "--block-size", "16",
              "--max-num-batched-tokens", "512", "--token-buckets", "64", "512",
              "--seq-buckets", "16")


def _schemas():
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=120)
        city: Literal["London", "Paris", "Bath", "Highbury"]

    class Item(BaseModel):
        title: str = Field(max_length=30)
        tags: list[Literal["book", "music", "film", "art"]] = Field(min_length=1, max_length=3)

    class Order(BaseModel):
        customer: Person
        items: list[Item] = Field(min_length=1, max_length=2)
        note: str | None = Field(default=None, max_length=30)   # anyOf: string or null
        code: int | Literal["none"] = 0                          # anyOf: integer or enum

    return Person, Item, Order


@pytest.mark.slow
def test_openai_parse_regex_and_choice_against_the_default_model(tmp_path):
    """The official client's ``chat.completions.parse`` with three pydantic models (nested
    objects, arrays with minItems, enums, anyOf) at temperature 0.7 against a live ``jaxkv
    serve`` of the default model: 50 prompts each, 16 at a time, every one parsed; dates,
    e-mails and a choice list 100% matching."""
    import concurrent.futures

    from test_server import NAME, LiveServer

    openai = pytest.importorskip("openai")
    live = LiveServer("SmolLM2-135M-Instruct", tmp_path / "server.log", *REAL_FLAGS)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)

        def ask(model, i):
            r = client.chat.completions.parse(
                model=NAME, temperature=0.7, seed=i, max_tokens=256, response_format=model,
                messages=[{"role": "user", "content": f"Describe {model.__name__} number {i} "
                                                      f"from Emma by Jane Austen as JSON."}])
            return r.choices[0].message.parsed

        def constrained(body, i):
            r = client.chat.completions.create(
                model=NAME, temperature=0.7, seed=i, max_tokens=48,
                messages=[{"role": "user", "content": f"Answer {i}."}],
                extra_body={"structured_outputs": body})
            return r.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for model in _schemas():
                parsed = list(pool.map(lambda i, m=model: ask(m, i), range(50)))
                assert all(isinstance(p, model) for p in parsed), model.__name__
            for body, ok in ((dict(regex=DATE), lambda t: re.fullmatch(DATE, t)),
                             (dict(regex=EMAIL), lambda t: re.fullmatch(EMAIL, t)),
                             (dict(choice=CHOICES), lambda t: t in CHOICES)):
                texts = list(pool.map(lambda i, b=body: constrained(b, i), range(20)))
                assert all(ok(t) for t in texts), (body, texts)
    finally:
        live.stop()
