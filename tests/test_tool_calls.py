"""Tool calling (issue 54): the parsers (whole and streamed answers agree on every prefix), the
plan of ``tools`` / ``tool_choice`` and its errors, the rendering for a template without tools,
and a live ``jaxkv serve --tool-call-parser hermes`` driven by the official ``openai`` client:
named, required and auto calls, whole and streamed (assembled by the client's own stream
helper), n=2, with n-gram speculation on and a pool small enough to preempt, greedy tokens
equal to an offline engine without either."""

import json
import random
import re

import httpx
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.sample.structured import StructuredOutputsParams
from jaxkv.server import tools
from jaxkv.server.protocol import FieldError
from jaxkv.server.tool_calls import PARSERS, CallStream, RequiredArray, ToolCall, message

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from test_server import NAME, LiveServer, engine_flags, openai_client, scrape, value  # noqa: E402

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"enum": ["Paris", "Rome", "Bath"]},
                       "unit": {"enum": ["C", "F"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"$ref": "#/$defs/zone"}},
        "$defs": {"zone": {"enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]

# ---------------------------------------------------------------------- parsers

ANSWERS = {
    "hermes": [
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "UTC"}}\n</tool_call>',
        "no calls at all, just < and <tool text",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then <tool_call>{bad',
        '<tool_call>not json</tool_call><tool_call>{"name": "g", "arguments": "{\\"a\\": 1}"}'
        '</tool_call>',
    ],
    "smollm2": [
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_call>',
        "<tool_call>[]</tool_call>",
        "I cannot <tool_ help",
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Bath", "unit": "C"}}; '
        '{"name": "get_time", "parameters": {"zone": "UTC"}}',
        '<|python_tag|>{"name": "f", "parameters": {"x": [1, 2]}}',
        "Plain text { not a call",
        '{"answer": 42} is not a call',
        '{"name": "f", "parameters": {}} trailing words',
    ],
}
WANT = {
    ("hermes", 0): ("Let me check.", [("get_weather", {"city": "Paris", "unit": "C"}),
                                      ("get_time", {"zone": "UTC"})]),
    ("hermes", 1): ("no calls at all, just < and <tool text", []),
    ("hermes", 2): ("and then <tool_call>{bad", [("f", {})]),
    ("hermes", 3): ("<tool_call>not json</tool_call>", [("g", {"a": 1})]),
    ("smollm2", 0): ("", [("get_weather", {"city": "Rome", "unit": "F"}),
                          ("get_time", {"zone": "CET"})]),
    ("smollm2", 1): ("<tool_call>[]</tool_call>", []),
    ("smollm2", 2): ("I cannot <tool_ help", []),
    ("llama3_json", 0): ("", [("get_weather", {"city": "Bath", "unit": "C"}),
                              ("get_time", {"zone": "UTC"})]),
    ("llama3_json", 1): ("", [("f", {"x": [1, 2]})]),
    ("llama3_json", 2): ("Plain text { not a call", []),
    ("llama3_json", 3): ('{"answer": 42} is not a call', []),
    ("llama3_json", 4): ("trailing words", [("f", {})]),
}
CASES = [(name, i) for name, texts in ANSWERS.items() for i in range(len(texts))]


def _parsed_calls(parsed) -> list:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("name,i", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_parsers_find_the_calls_and_the_content(name, i):
    parsed = PARSERS[name].parse(ANSWERS[name][i], final=True)
    want_content, want_calls = WANT[(name, i)]
    assert (parsed.content, _parsed_calls(parsed)) == (want_content, want_calls)


def _assemble(parser, text: str, cuts: list[int]) -> dict:
    """A message assembled from a stream's deltas, as the openai client does."""
    stream, content, calls = CallStream(parser), None, {}
    for end in [*cuts, len(text)]:
        delta = stream.delta(text[:end], finished=end == len(text))
        if "content" in delta:
            content = (content or "") + delta["content"]
        for d in delta.get("tool_calls", []):
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            call["name"] += d.get("function", {}).get("name", "")
            call["arguments"] += d.get("function", {}).get("arguments", "")
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("name,i", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_every_prefix_settles_a_prefix_and_streams_assemble_the_whole(name, i):
    """For every prefix, the parser's content and calls are prefixes of the whole text's; a
    stream cut character by character, or at random points, assembles the whole message."""
    parser, text = PARSERS[name], ANSWERS[name][i]
    whole = parser.parse(text, final=True)
    for end in range(len(text) + 1):
        part = parser.parse(text[:end], final=False)
        assert whole.content.startswith(part.content), (end, part)
        assert len(part.calls) <= len(whole.calls)
        assert all(w.name == p.name and w.arguments.startswith(p.arguments)
                   for p, w in zip(part.calls, whole.calls)), end
    msg, has_calls = message(parser, text)
    want = {"content": msg["content"],
            "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in msg.get("tool_calls", [])]}
    rng = random.Random(i)
    for cuts in (list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), 5))):
        got = _assemble(parser, text, cuts)
        if not has_calls and got["content"] is None:
            got["content"] = ""
        assert got == want


def test_required_array_sends_each_call_once_complete():
    text = '[{"name":"get_weather","parameters":{"city":"Paris","unit":"C"}},' \
           '{"name":"get_time","parameters":{"zone":"UTC"}}]'
    parser = RequiredArray()
    assert parser.parse(text[:40], final=False).calls == ()
    assert len(parser.parse(text[:70], final=False).calls) == 1
    assert parser.parse(text, final=True).calls == (
        ToolCall("get_weather", '{"city": "Paris", "unit": "C"}'),
        ToolCall("get_time", '{"zone": "UTC"}'))


# ---------------------------------------------------------------------- plans


def test_named_and_required_plans_are_enforced_by_schemas():
    named = tools.plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None,
                       None)
    assert named.choice == "named" and json.loads(named.constraint.json) == TIME
    assert named.constraint.disable_any_whitespace
    required = tools.plan(TOOLS, "required", False, None)
    schema = json.loads(required.constraint.json)
    ok = [{"name": "get_time", "parameters": {"zone": "CET"}}]
    jsonschema.validate(ok, schema)
    for bad in ([], ok * 2, [{"name": "get_time", "parameters": {"zone": "PST"}}],
                [{"name": "get_weather", "parameters": {"zone": "UTC"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "maxItems" not in json.loads(tools.plan(TOOLS, "required", None, None)
                                        .constraint.json)
    assert tools.plan(TOOLS, None, None, "hermes").choice == "auto"
    assert tools.plan(TOOLS, "none", None, None).parser is None
    assert tools.plan(None, None, None, None) is None


BAD_PLANS = [
    ("tools[0].function.name", dict(tools=[{"type": "function", "function": {}}])),
    ("tools[0].function.name", dict(tools=[{"type": "function", "function": {"name": "a b"}}])),
    ("tools[1].function.name", dict(tools=[TOOLS[0], TOOLS[0]])),
    ("tools[0].type", dict(tools=[{"type": "code", "function": {"name": "f"}}])),
    ("tools[0].function.parameters", dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": []}}])),
    ("tool_choice", dict(tool_choice={"type": "function", "function": {"name": "absent"}})),
    ("tool_choice", dict(tool_choice="sometimes")),
    ("tool_choice", dict(tools=None, tool_choice="required")),
    ("tool_choice", dict(tool_choice="auto", parser=None)),
]


@pytest.mark.parametrize("field,kw", BAD_PLANS, ids=[f"{f}-{i}" for i, (f, _) in
                                                     enumerate(BAD_PLANS)])
def test_bad_tools_name_the_field(field, kw):
    kw = {"tools": TOOLS, "tool_choice": None, "parser": "hermes", **kw}
    with pytest.raises(FieldError) as e:
        tools.plan(kw["tools"], kw["tool_choice"], None, kw["parser"])
    assert e.value.param == field and field in str(e.value)


def test_a_template_without_tools_gets_them_in_the_parsers_format():
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Bath", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]
    plan = tools.plan(TOOLS, "auto", None, "smollm2")
    messages, variables = tools.render(plan, history, False, "smollm2")
    assert variables == {}
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert all(json.dumps(t) in messages[0]["content"] for t in TOOLS)
    assert messages[2] == {"role": "assistant", "content": '<tool_call>[{"name": "get_weather",'
                                                           ' "arguments": {"city": "Bath", '
                                                           '"unit": "C"}}]</tool_call>'}
    assert messages[3] == {"role": "user",
                           "content": "<tool_response>\n12 degrees\n</tool_response>"}
    kept, variables = tools.render(plan, history, True, "smollm2")
    assert variables == {"tools": TOOLS} and kept[1]["tool_calls"][0]["function"][
        "arguments"] == {"city": "Bath", "unit": "C"} and kept[2] == history[2]
    assert tools.template_renders_tools("{% for t in tools %}{{ t }}{% endfor %}")
    assert not tools.template_renders_tools("{{ messages[0]['content'] }}")


# ---------------------------------------------------------------------- live server

ENGINE = dict(max_model_len=1024, max_num_seqs=8, num_kv_blocks=140, block_size=8,
              max_num_batched_tokens=64, token_buckets=(16, 64), seq_buckets=(8,))
SPEC = dict(speculative="ngram", num_speculative_tokens=3)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# an auto answer the tiny random model is steered to write by a regex (the parser reads it)
AUTO_REGEX = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": '
              r'"(Paris|Rome)", "unit": "(C|F)"\}\}</tool_call>')


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama with positions for the tools' system prompt (~720 tokens here)."""
    from tiny_models import save_tiny_model, save_tokenizer

    path = tmp_path_factory.mktemp("tiny-tools")
    save_tokenizer(path)
    save_tiny_model(path, "llama", max_position_embeddings=2048)
    return path


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    live = LiveServer(model, tmp_path_factory.mktemp("serve") / "tools.log",
                      "--tool-call-parser", "hermes", *engine_flags(SPEC),
                      "--no-speculative-adaptive", *engine_flags(ENGINE))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model):
    with LLM(str(model), **{**ENGINE, "num_kv_blocks": 400}) as llm:
        yield llm


def _create(client, **kw):
    return client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, **kw)


def _stream(client, **kw):
    """The completion the openai client's stream helper assembles from the deltas."""
    with client.chat.completions.stream(model=NAME, messages=MESSAGES, tools=TOOLS,
                                        **kw) as stream:
        return stream.get_final_completion()


def _calls(choice) -> list:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or []]


def _offline_text(offline, constraint, max_tokens):
    messages, variables = tools.render(tools.plan(TOOLS, "auto", None, "hermes"), MESSAGES,
                                       False, "hermes")
    text = offline.tokenizer.apply_chat_template(messages, **variables)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
    out = offline.generate({"prompt_token_ids": offline.tokenizer.encode(text, False)},
                           params, use_tqdm=False)
    return out[0].outputs[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_named_call_equals_the_offline_engine_and_streams_the_same(client, offline, stream):
    """A named call: the arguments the grammar enforced, equal (greedy, drafts verified, a
    small pool) to the offline engine's without speculation; whole or streamed."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = (_stream if stream else _create)(client, tool_choice=choice, temperature=0,
                                         max_tokens=40)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [(name, args)] = _calls(c)
    jsonschema.validate(args, CITY)
    want = _offline_text(offline, StructuredOutputsParams(json=CITY, disable_any_whitespace=True),
                         40)
    assert (name, c.message.tool_calls[0].function.arguments) == ("get_weather", want)
    assert c.message.tool_calls[0].id.startswith("call_")


def test_required_calls_n2_sampled_whole_and_streamed(client):
    """Sampled (one call each: the random model's arrays would run past max_tokens), n=2; the
    stream assembles what the whole answer holds, seed for seed."""
    kw = dict(tool_choice="required", parallel_tool_calls=False, n=2, temperature=1.0,
              max_tokens=120)
    whole, streamed = _create(client, seed=9, **kw), _stream(client, seed=9, **kw)
    assert [_calls(c) for c in whole.choices] == [_calls(c) for c in streamed.choices]
    for c in [*whole.choices, *streamed.choices]:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        for name, args in _calls(c):
            jsonschema.validate(args, {"get_weather": CITY, "get_time": TIME}[name])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_are_parsed_from_the_text(client, stream):
    r = (_stream if stream else _create)(
        client, temperature=0.8, seed=1, max_tokens=150, n=2,
        extra_body={"structured_outputs": {"regex": AUTO_REGEX}})
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
        [(name, args)] = _calls(c)
        assert name == "get_weather" and args["city"] in ("Paris", "Rome")


def test_auto_without_a_call_is_content_and_none_renders_no_calls(client):
    r = _create(client, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content
    r = _create(client, tool_choice="none", temperature=0, max_tokens=150,
                extra_body={"structured_outputs": {"regex": AUTO_REGEX}})
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert re.fullmatch(AUTO_REGEX, r.choices[0].message.content)


def test_a_round_trip_renders_the_call_and_its_result(client, server):
    """The model's call and the tool's answer go back in the next turn, rendered in the
    parser's format (the tiny template has no tools): the prompt counts what that text
    tokenizes to."""
    first = _create(client, tool_choice="required", parallel_tool_calls=False, temperature=0,
                    max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    second = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS,
                                            tool_choice="none", max_tokens=4, temperature=0)
    rendered, _ = tools.render(tools.plan(TOOLS, "none", None, "hermes"), history, False,
                               "hermes")
    want = httpx.post(server.url + "/tokenize", json={"messages": rendered}).json()["count"]
    assert second.usage.prompt_tokens == want
    assert rendered[-1]["content"] == "<tool_response>\n21 degrees\n</tool_response>"
    assert f'"name": "{call.function.name}"' in rendered[-2]["content"]


def test_named_calls_stay_exact_while_the_pool_preempts(server, client, offline):
    """Named calls (greedy, drafts verified under the grammar) sent among long answers that
    overflow the pool (140 blocks of 8; the shared prompt takes 91): the server preempts, and
    every call equals the offline engine's, which neither drafts nor preempts."""
    import concurrent.futures

    choice = {"type": "function", "function": {"name": "get_weather"}}
    want = _offline_text(offline, StructuredOutputsParams(json=CITY, disable_any_whitespace=True),
                         40)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        load = [pool.submit(_create, client, n=4, temperature=1.0, seed=s, max_tokens=150,
                            extra_body={"ignore_eos": True}) for s in range(3)]
        calls = [pool.submit(_create, client, tool_choice=choice, temperature=0, max_tokens=40)
                 for _ in range(4)]
        assert all(len(f.result().choices) == 4 for f in load)
        assert [f.result().choices[0].message.tool_calls[0].function.arguments
                for f in calls] == [want] * 4
    with httpx.Client(base_url=server.url) as http:
        families = scrape(http)
    assert value(families, "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_draft_tokens_total") > 0
    assert value(families, "vllm:num_preemptions", "vllm:num_preemptions_total") > 0


BAD_REQUESTS = [
    ("tools[0].function.name", dict(tools=[{"type": "function", "function": {"name": ""}}])),
    ("tool_choice", dict(tool_choice={"type": "function", "function": {"name": "nope"}})),
    ("tool_choice", dict(tool_choice="required", response_format={"type": "json_object"})),
    ("tools", dict(tool_choice="required", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "frob"}}}])),
    ("messages[1].tool_calls[0].function.arguments", dict(messages=[
        *MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f",
                                                                      "arguments": "{x"}}]}])),
]


@pytest.mark.parametrize("field,kw", BAD_REQUESTS,
                         ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_REQUESTS)])
def test_bad_tool_requests_are_400_naming_the_field_and_the_server_goes_on(client, field, kw):
    body = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert field in e.value.response.json()["error"]["message"]
    assert _create(client, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=120).choices[0].message.tool_calls


@pytest.mark.slow
def test_calls_round_trip_against_the_default_model(tmp_path):
    """SmolLM2-135M-Instruct behind ``--tool-call-parser smollm2``, 12 questions at
    temperature 0.7: named and required calls valid against their schemas, whole and streamed
    alike; each call's result sent back gets a text answer. ``auto`` answers in text: this
    model does not write calls unprompted (its answers parse as content)."""
    from test_structured_outputs import REAL_FLAGS

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                       "properties": {"city": {"type": "string", "maxLength": 20}}}}}
    live = LiveServer("SmolLM2-135M-Instruct", tmp_path / "server.log", *REAL_FLAGS,
                      "--tool-call-parser", "smollm2")
    try:
        with openai_client(live) as c:
            for i, city in enumerate(["Paris", "Bath", "Rome", "Oslo"] * 3):
                messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
                kw = dict(model=NAME, messages=messages, tools=[weather], temperature=0.7,
                          seed=i, max_tokens=48)
                named = {"type": "function", "function": {"name": "get_weather"}}
                choice = (named, "required")[i % 2]
                whole = c.chat.completions.create(tool_choice=choice, **kw)
                with c.chat.completions.stream(tool_choice=choice, **kw) as s:
                    streamed = s.get_final_completion()
                calls = [r.choices[0].message.tool_calls for r in (whole, streamed)]
                assert [[(t.function.name, t.function.arguments) for t in cs] for cs in calls] \
                    == [[(t.function.name, t.function.arguments) for t in calls[0]]] * 2
                for t in calls[0]:
                    jsonschema.validate(json.loads(t.function.arguments),
                                        weather["function"]["parameters"])
                reply = c.chat.completions.create(**{**kw, "messages": [
                    *messages, whole.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": calls[0][0].id,
                     "content": "Sunny, 21 degrees."}]}, tool_choice="none")
                assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
            auto = c.chat.completions.create(model=NAME, messages=messages, tools=[weather],
                                             temperature=0, max_tokens=48)
            assert auto.choices[0].message.content
    finally:
        live.stop()


# a chat template that renders tools itself (Qwen 2.5's structure, shortened)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == "
    "'system' else 'You are helpful.' }}\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{%- elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}"
    "<|im_start|>assistant\n{{ m.content or '' }}{%- for c in m.tool_calls %}\n<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n{%- elif m.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role != 'system' or loop.index0 > 0 or not tools %}{%- if m.role != 'system' %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_template_with_tools_renders_them_as_transformers_does(tmp_path):
    """A checkpoint's template that reads ``tools`` gets them, and the earlier calls'
    arguments as objects: jaxkv's prompt equals transformers' ``apply_chat_template``."""
    import transformers
    from tiny_models import save_tokenizer

    from jaxkv.model.tokenizer import Tokenizer

    save_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)   # wins, as in transformers
    history = [{"role": "system", "content": "Be brief."}, *MESSAGES,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tools.template_renders_tools(tok.chat_template)
    messages, variables = tools.render(tools.plan(TOOLS, "auto", None, "hermes"), history,
                                       True, "hermes")
    ours = tok.apply_chat_template(messages, **variables)
    hf_history = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if "tool_calls" in m else m
        for m in history]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        hf_history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    assert '"arguments": {"city": "Rome", "unit": "C"}' in ours and "get_time" in ours
