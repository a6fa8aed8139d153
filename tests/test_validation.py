"""Request isolation: every field of a request is checked before anything is queued.

``SamplingParams`` on construction and ``RequestTable.new_request`` / ``tokenize`` (prompt shape,
token ids, stop ids against the vocabulary, priority, cache_salt, request_id) raise a
``TypeError`` for a wrong type and a plain ``ValueError`` for a wrong value, each naming the
field first. No engine is built: the table is tested directly over the tiny test tokenizer.
"""

import numpy as np
import pytest

from jaxkv.config.checks import ParamTypeError
from jaxkv.engine.requests import RequestTable
from jaxkv.model.tokenizer import Tokenizer
from jaxkv.sample.sampler import MAX_LOGPROBS
from jaxkv.sample.sampler import SamplingParams

VOCAB = 400
MAX_MODEL_LEN = 64
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny BPE tokenizer the engine tests use (``tiny_models.save_tokenizer``)."""
    from tiny_models import save_tokenizer

    return Tokenizer.from_hf_dir(save_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB))


@pytest.fixture
def table(tokenizer):
    """An empty ``RequestTable`` per test."""
    return RequestTable(tokenizer, VOCAB, MAX_MODEL_LEN)


# ---------------------------------------------------------------- SamplingParams: types

INT_FIELDS = ["n", "top_k", "max_tokens", "min_tokens"]
OPTIONAL_INT_FIELDS = ["seed", "logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty"]
BOOL_FIELDS = ["ignore_eos", "skip_special_tokens"]

BAD_TYPES = (
    [(f, v) for f in INT_FIELDS + OPTIONAL_INT_FIELDS
     for v in (1.5, 2.0, np.float64(1.0), "1", True, np.bool_(True), [1], 1 + 0j)]
    + [(f, None) for f in INT_FIELDS]
    + [(f, v) for f in FLOAT_FIELDS for v in ("0.5", True, None, [0.5], 1 + 0j)]
    + [(f, v) for f in BOOL_FIELDS for v in (1, 0, "yes", None)]
    + [("stop", v) for v in (3, b"x", {"a"}, ["a", 1], ("a", None), [["a"]])]
    + [("stop_token_ids", v) for v in ("eos", 7, {1}, [1.5], [True], ["1"], (1, None),
                                       np.array([1.0]), np.array([True]))]
)


@pytest.mark.parametrize("field, value", BAD_TYPES)
def test_params_reject_bad_types(field, value):
    with pytest.raises(TypeError, match=rf"^{field}\b"):
        SamplingParams(**{field: value})


def test_type_errors_are_also_value_errors():
    """ParamTypeError keeps ``except ValueError`` callers (CLI, generate) reporting it."""
    with pytest.raises(ParamTypeError) as e:
        SamplingParams(max_tokens=1.5)
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)
    assert str(e.value) == "max_tokens=1.5 is not an int"


# ---------------------------------------------------------------- SamplingParams: values

BAD_VALUES = [
    ("temperature", NAN), ("temperature", INF), ("temperature", -INF), ("temperature", -0.1),
    ("temperature", 1e39), ("temperature", 10 ** 400), ("temperature", np.float32(NAN)),
    ("top_p", 0.0), ("top_p", 1.0000001), ("top_p", -0.5), ("top_p", NAN),
    ("top_k", -2), ("top_k", -100),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", NAN),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", INF),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", NAN),
    ("frequency_penalty", -3.0), ("frequency_penalty", 2.01), ("frequency_penalty", INF),
    ("n", 0), ("n", -1),
    ("max_tokens", 0), ("max_tokens", -5),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("seed", -1), ("seed", 2 ** 64),
    ("stop_token_ids", [-1]), ("stop_token_ids", [3, -7]),
    ("stop_token_ids", np.zeros((1, 2), int)),
]


@pytest.mark.parametrize("field, value", BAD_VALUES)
def test_params_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=rf"^{field}\b") as e:
        SamplingParams(**{field: value})
    assert not isinstance(e.value, TypeError)


def test_min_tokens_bounded_by_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens=5 must be in \[0, 4\] \(max_tokens=4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


def test_element_errors_name_their_index():
    with pytest.raises(ValueError, match=r"^stop_token_ids=\[3, -7\]: stop_token_ids\[1\]=-7 "):
        SamplingParams(stop_token_ids=[3, -7])
    with pytest.raises(TypeError, match=r"^stop=\['a', 1\]: stop\[1\]=1 is not a str"):
        SamplingParams(stop=["a", 1])


# ---------------------------------------------------------------- SamplingParams: accepted edges

def test_params_accept_edge_values_and_store_plain_types():
    p = SamplingParams(n=np.int64(2), temperature=0, top_p=np.float32(1.0), top_k=np.int32(5),
                       min_p=1, repetition_penalty=1e-3, presence_penalty=-2,
                       frequency_penalty=2.0, seed=np.uint64(2 ** 64 - 1), stop=("a", "b"),
                       stop_token_ids=np.array([0, 9]), max_tokens=np.int16(3), min_tokens=3,
                       logprobs=np.int8(0), ignore_eos=np.bool_(True))
    for name, kind in [("n", int), ("temperature", float), ("top_p", float), ("top_k", int),
                       ("min_p", float), ("presence_penalty", float), ("seed", int),
                       ("max_tokens", int), ("logprobs", int), ("ignore_eos", bool)]:
        assert type(getattr(p, name)) is kind, name
    assert (p.n, p.top_k, p.seed, p.max_tokens, p.logprobs) == (2, 5, 2 ** 64 - 1, 3, 0)
    assert p.temperature == 0.0 and p.greedy and p.ignore_eos is True
    assert p.stop == ("a", "b") and p.stop_token_ids == (0, 9)
    assert all(type(i) is int for i in p.stop_token_ids)
    hash(p)


@pytest.mark.parametrize("top_k, stored", [(-1, -1), (0, -1), (1, 1), (10 ** 6, 10 ** 6)])
def test_top_k_off_is_minus_one(top_k, stored):
    """-1 and 0 both disable top-k (vLLM); 0 is stored as -1, so equal params are equal."""
    assert SamplingParams(top_k=top_k).top_k == stored
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)


def test_params_defaults_and_replace_unchanged():
    import dataclasses

    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.max_tokens, p.seed, p.stop, p.stop_token_ids) == (
        1, 1.0, -1, 16, None, (), ())
    q = SamplingParams(seed=3, stop="x", top_k=0)
    assert dataclasses.replace(q, seed=4) == SamplingParams(seed=4, stop=("x",), top_k=-1)


# ---------------------------------------------------------------- RequestTable: prompts

BAD_PROMPTS = [
    # the reproduced defects: a string of digits, float ids (were truncated), out of vocab
    ({"prompt_token_ids": "123"}, TypeError, r"^prompt_token_ids='123' is not a list"),
    ({"prompt_token_ids": [1, 2, 3, 1.5]}, TypeError,
     r"^prompt_token_ids=.*: prompt_token_ids\[3\]=1\.5 is not an int"),
    ({"prompt_token_ids": [1.0, 2.0]}, TypeError, r"prompt_token_ids\[0\]=1\.0 is not an int"),
    ({"prompt_token_ids": [1, True]}, TypeError, r"prompt_token_ids\[1\]=True is not an int"),
    ({"prompt_token_ids": [1, "2"]}, TypeError, r"prompt_token_ids\[1\]='2' is not an int"),
    ({"prompt_token_ids": [1, None]}, TypeError, r"prompt_token_ids\[1\]=None is not an int"),
    ({"prompt_token_ids": [np.float32(3)]}, TypeError, r"prompt_token_ids\[0\]=.* is not an int"),
    ({"prompt_token_ids": np.array([1.0, 2.0])}, TypeError, r"^prompt_token_ids has dtype float"),
    ({"prompt_token_ids": np.array([True])}, TypeError, r"^prompt_token_ids has dtype bool"),
    ({"prompt_token_ids": 5}, TypeError, r"^prompt_token_ids=5 is not a list"),
    ({"prompt_token_ids": {1, 2}}, TypeError, r"^prompt_token_ids=.* is not a list"),
    ({"prompt_token_ids": iter([1, 2])}, TypeError, r"^prompt_token_ids=.* is not a list"),
    ({"prompt_token_ids": [1, VOCAB]}, ValueError,
     rf"prompt_token_ids\[1\]={VOCAB} must be in \[0, {VOCAB}\) \(vocab_size={VOCAB}\)"),
    ({"prompt_token_ids": [-1]}, ValueError, r"prompt_token_ids\[0\]=-1 must be in"),
    ({"prompt_token_ids": [10 ** 30]}, ValueError, r"prompt_token_ids\[0\]=.* must be in"),
    ({"prompt_token_ids": np.array([[1, 2]])}, ValueError, r"^prompt_token_ids must be 1-D"),
    ({"prompt_token_ids": np.array([3, VOCAB])}, ValueError, r"prompt_token_ids\[1\]=400"),
    ({"prompt_token_ids": []}, ValueError, r"^prompt_token_ids must not be empty"),
    ({"prompt_token_ids": np.array([], np.int32)}, ValueError, r"^prompt_token_ids must not be"),
    # dict shape
    ({"prompt_token_ids": [1], "prompt": 5}, TypeError, r"^prompt\['prompt'\]=5 is not"),
    ({"prompt_token_ids": [1], "prompt": b"hi"}, TypeError, r"^prompt\['prompt'\]=b'hi'"),
    ({"prompt_token_ids": [1], "extra": 1}, ValueError, r"^prompt has keys .*'extra'"),
    ({"prompt_token_ids": [1], 3: 1}, ValueError, r"^prompt has keys"),
    ({"prompt": "hello"}, ValueError, r"^prompt has keys \['prompt'\]: it must have"),
    ({}, ValueError, r"^prompt has keys \[\]"),
    # not a prompt at all
    ("", ValueError, r"^prompt must not be empty"),
    ([1, 2, 3], TypeError, r"^prompt=\[1, 2, 3\] is not a str or a dict"),
    (b"hello", TypeError, r"^prompt=b'hello' is not a str"),
    (None, TypeError, r"^prompt=None is not"),
    (123, TypeError, r"^prompt=123 is not"),
]


@pytest.mark.parametrize("prompt, error, match", BAD_PROMPTS)
def test_bad_prompts_raise_naming_the_field(table, prompt, error, match):
    for call in (lambda: table.tokenize(prompt),
                 lambda: table.new_request(prompt, SamplingParams())):
        with pytest.raises(error, match=match) as e:
            call()
        assert error is TypeError or not isinstance(e.value, TypeError)
    assert not table.requests and not table.samples


@pytest.mark.parametrize("ids", [[5, 6, 7], (5, 6, 7), [np.int64(5), np.int32(6), 7],
                                 np.array([5, 6, 7]), np.array([5, 6, 7], np.uint16)])
def test_token_prompts_accepted_as_lists_of_python_ints(table, ids):
    text, out = table.tokenize({"prompt_token_ids": ids})
    assert text is None and out == [5, 6, 7] and all(type(i) is int for i in out)
    text, out = table.tokenize({"prompt_token_ids": ids, "prompt": "abc"})
    assert text == "abc" and out == [5, 6, 7]
    assert table.tokenize({"prompt_token_ids": [0, VOCAB - 1], "prompt": None})[1] == [0, VOCAB - 1]


def test_text_prompt_tokenized(table):
    text, ids = table.tokenize("Emma Woodhouse")
    assert text == "Emma Woodhouse" and ids == table.tokenizer.encode("Emma Woodhouse")
    assert all(0 <= i < VOCAB for i in ids)


# ---------------------------------------------------------------- RequestTable: other fields

PROMPT = {"prompt_token_ids": [5, 6, 7]}

BAD_FIELDS = [
    # the reproduced defects: accepted, then broke every later engine step
    (dict(params=SamplingParams(stop_token_ids=[10 ** 9])), ValueError,
     r"^stop_token_ids=\(1000000000,\): stop_token_ids\[0\]=1000000000 must be in \[0, 400\)"),
    (dict(params=SamplingParams(stop_token_ids=[1, VOCAB])), ValueError,
     r"^stop_token_ids=.*\[1\]=400 must be in"),
    (dict(cache_salt=["x"]), TypeError, r"^cache_salt=\['x'\] is not None or a str"),
    (dict(cache_salt=1), TypeError, r"^cache_salt=1 is not"),
    (dict(cache_salt=b"x"), TypeError, r"^cache_salt=b'x' is not"),
    (dict(cache_salt=("x",)), TypeError, r"^cache_salt="),
    (dict(priority=1.5), TypeError, r"^priority=1\.5 is not an int"),
    (dict(priority="1"), TypeError, r"^priority='1' is not an int"),
    (dict(priority=True), TypeError, r"^priority=True is not an int"),
    (dict(priority=None), TypeError, r"^priority=None is not an int"),
    (dict(priority=[0]), TypeError, r"^priority="),
    (dict(request_id=1.5), TypeError, r"^request_id=1\.5 is not None, a str or an int"),
    (dict(request_id=True), TypeError, r"^request_id=True is not"),
    (dict(request_id=["a"]), TypeError, r"^request_id="),
    (dict(request_id=b"a"), TypeError, r"^request_id="),
    (dict(params=None), TypeError, r"^sampling_params=None is not a SamplingParams"),
    (dict(params={"temperature": 0}), TypeError, r"^sampling_params="),
    (dict(params=SamplingParams(logprobs=MAX_LOGPROBS + 1)), ValueError,
     rf"^logprobs={MAX_LOGPROBS + 1} exceeds max_logprobs"),
    (dict(params=SamplingParams(max_tokens=MAX_MODEL_LEN)), ValueError,
     r"^the prompt's 3 tokens \+ max_tokens=64 exceed max_model_len"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_FIELDS)
def test_bad_request_fields_raise_naming_the_field(table, kwargs, error, match):
    params = kwargs.pop("params", SamplingParams())
    with pytest.raises(error, match=match) as e:
        table.new_request(PROMPT, params, **kwargs)
    assert error is TypeError or not isinstance(e.value, TypeError)
    assert not table.requests and not table.samples


def test_valid_request_after_rejections(table):
    """After poison requests the table takes a valid one, with its fields normalised."""
    for bad in (dict(cache_salt=["x"]), dict(priority=0.5)):
        with pytest.raises(TypeError):
            table.new_request(PROMPT, SamplingParams(), **bad)
    params = SamplingParams(n=2, seed=1, stop_token_ids=(VOCAB - 1,), max_tokens=4)
    req, reqs = table.new_request(PROMPT, params, priority=np.int64(-3), cache_salt="tenant")
    assert [r.request_id for r in reqs] == [f"{req.request_id}#0", f"{req.request_id}#1"]
    assert all(type(r.priority) is int and r.priority == -3 for r in reqs)
    assert all(r.cache_salt == "tenant" and r.prompt_token_ids == (5, 6, 7) for r in reqs)
    assert [s.params.seed for s in req.samples] == [1, 2]
    assert not table.requests   # new_request adds nothing; ``add`` does


def test_request_ids(table):
    """str ids are kept, int ids become their decimal str, auto ids skip ids in use."""
    req, reqs = table.new_request(PROMPT, SamplingParams(), request_id="a")
    assert req.request_id == "a"
    table.add([(req, reqs)])
    for given in (7, np.int64(7)):
        assert table.new_request(PROMPT, SamplingParams(), request_id=given)[0].request_id == "7"
    with pytest.raises(ValueError, match=r"^request_id='a' is already in use"):
        table.new_request(PROMPT, SamplingParams(), request_id="a")
    nxt = table.new_request(PROMPT, SamplingParams())[0].request_id
    taken = str(int(nxt) + 1)
    table.add([table.new_request(PROMPT, SamplingParams(), request_id=taken)])
    assert table.new_request(PROMPT, SamplingParams())[0].request_id == str(int(nxt) + 2)
    with pytest.raises(ValueError, match=rf"^request_id='{taken}' is already in use"):
        table.new_request(PROMPT, SamplingParams(), request_id=int(taken))


@pytest.mark.parametrize("kwargs, error", [
    (dict(num_kv_blocks=1), "^num_kv_blocks=1 must be >= 2"),
    (dict(num_gpu_blocks_override=1), "^num_gpu_blocks_override=1 must be >= 2"),
    (dict(memory_utilization=2.0), r"^memory_utilization=2.0 must be in \[0.001, 1.0\]"),
    (dict(kv_cache_bytes="4GiB"), "^kv_cache_bytes='4GiB' is not an int"),
    (dict(kv_cache_dtype="int3"), "^kv_cache_dtype='int3' is not one of: auto, fp32"),
])
def test_engine_argument_errors_name_the_argument_as_given(kwargs, error):
    from jaxkv.config import EngineConfig

    with pytest.raises(ValueError, match=error):
        EngineConfig.from_kwargs(**kwargs)
