"""Tool calls in an answer: the parsers that find the calls a model wrote in its text, and the
calls as OpenAI's ``tool_calls``, in a whole message or as streamed deltas.

A parser reads the text so far (``final=False``) or all of it. Its contract makes streaming
exact: for any prefix of a text, the content it returns is a prefix of the whole text's content,
and its calls are a prefix of the whole text's calls (the last one's arguments may still grow),
so a stream sends only differences and the client assembles what a whole answer returns.

Design notes: docs/server.md."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

_SEPARATORS = re.compile(r"\s*;?\s*")      # between Llama 3's calls
_ELEMENTS = re.compile(r"[\s,]*")          # between a JSON array's elements


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What a text holds: its content (the text that is no call) and its calls, in order."""

    content: str
    calls: tuple[ToolCall, ...] = ()


def _call(obj, arguments_key: str = "arguments") -> ToolCall | None:
    """The call a decoded JSON object spells (``{"name": str, <arguments_key>: {...}}``)."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):          # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _leading_calls(text: str, pos: int, between: re.Pattern) -> tuple[list[ToolCall], int]:
    """The calls that consecutive JSON objects of ``text`` spell from ``pos`` on (``between``:
    what separates them), and where they end."""
    calls, decoder = [], json.JSONDecoder()
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            break
        call = _call(obj, "parameters")
        if call is None:
            break
        calls.append(call)
        pos = between.match(text, end).end()
    return calls, pos


def _listed(tools: list[dict]) -> str:
    """Tools one JSON object per line, for a system prompt."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` a stream holds back: trailing whitespace
    before the longest suffix that could begin ``marker``."""
    n = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1)
              if marker.startswith(text[-k:])), 0)
    return len(text) - len(text[:len(text) - n].rstrip())


class TaggedJSON:
    """Calls as JSON between tags: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (Hermes 2 Pro, Qwen 2.5/3), or a list of such objects in one tag (SmolLM2's function-calling
    format). The text before the first tag is the content; a block that does not parse, and
    text after the blocks, join the content when the text ends; a text without calls is all
    content."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self, name: str, prompt: str, call_format: str):
        self.name, self.prompt, self.call_format = name, prompt, call_format

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return Parsed(text if final else text[:len(text) - _held(text, self.start)])
        calls, extra, pos = [], [], first
        while True:
            j = text.find(self.start, pos)
            k = text.find(self.end, j) if j >= 0 else -1
            if k < 0:                       # no further block, or one not closed yet
                extra.append(text[pos:])
                break
            extra.append(text[pos:j])
            body = self._calls(text[j + len(self.start):k])
            calls += body or []
            extra.append(text[j:k + len(self.end)] if body is None else "")
            pos = k + len(self.end)
        if final and not calls:
            return Parsed(text)
        content = text[:first].rstrip()
        rest = "".join(e for e in extra if e.strip()).strip() if final else ""
        return Parsed(f"{content} {rest}" if content and rest else content or rest, tuple(calls))

    @staticmethod
    def _calls(body: str) -> list[ToolCall] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        calls = [_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        return None if None in calls else calls     # [] is SmolLM2's "no call needed"

    def system_prompt(self, tools: list[dict]) -> str:
        return self.prompt.format(tools=_listed(tools))

    def render_calls(self, calls: list[ToolCall]) -> str:
        """An earlier assistant turn's calls, in the format the model writes them."""
        objs = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]
        if self.call_format == "list":
            return f"{self.start}{json.dumps(objs, ensure_ascii=False)}{self.end}"
        return "\n".join(f"{self.start}\n{json.dumps(o, ensure_ascii=False)}\n{self.end}"
                         for o in objs)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JSON:
    """Llama 3.1/3.2's JSON calls: the answer is ``{"name": ..., "parameters": {...}}`` (or
    several, separated by ``;``), perhaps after ``<|python_tag|>``; an answer that does not begin
    with ``{`` is content. Objects after the calls that are not calls join the content at the
    end; an answer whose first object is no call is all content."""

    name = "llama3_json"
    tag = "<|python_tag|>"
    prompt = ("Given the following functions, please respond with a JSON for a function call "
              "with its proper arguments that best answers the given prompt.\n\n"
              "Respond in the format {{\"name\": function name, \"parameters\": dictionary of "
              "argument name and its value}}. Do not use variables.\n\n{tools}")

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        body = body[len(self.tag):].lstrip() if body.startswith(self.tag) else body
        if not body or (self.tag.startswith(text.strip()) and not final):
            return Parsed(text if final else "")
        if not body.startswith("{"):
            return Parsed(text)
        calls, pos = _leading_calls(body, 0, _SEPARATORS)
        if not calls:
            return Parsed(text if final else "")
        rest = body[pos:] if final else ""
        return Parsed(rest if rest.strip() else "", tuple(calls))

    def system_prompt(self, tools: list[dict]) -> str:
        return self.prompt.format(tools=_listed(tools))

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": json.loads(c.arguments)},
                                    ensure_ascii=False) for c in calls)

    def render_result(self, content: str) -> str:
        return content


class NamedArguments:
    """``tool_choice`` naming a function: the whole answer is its arguments (a JSON object the
    grammar enforces), streamed as they grow."""

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", (ToolCall(self.function, text),))


class RequiredArray:
    """``tool_choice="required"``: the answer is ``[{"name": ..., "parameters": {...}}, ...]``
    (vLLM's schema, enforced by the grammar); each call is sent once its object is complete."""

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find("[")
        if start < 0:
            return Parsed("")
        calls, _ = _leading_calls(text, _ELEMENTS.match(text, start + 1).end(), _ELEMENTS)
        return Parsed("", tuple(calls))


def call_body(call: ToolCall, call_id: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message(parser, text: str) -> tuple[dict, bool]:
    """The assistant ``message`` of a whole answer and whether it holds calls: ``tool_calls``
    (and ``content`` None where no text is left) when the parser finds any."""
    parsed: Parsed = parser.parse(text, final=True)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}, False
    return {"role": "assistant", "content": parsed.content or None,
            "tool_calls": [call_body(c, new_call_id()) for c in parsed.calls]}, True


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` for an answer that ended with calls."""
    return "tool_calls" if has_calls and reason == "stop" else reason


class CallStream:
    """The deltas of one streamed choice with tools: its content and calls as they become
    settled (tool_parsers' contract), each call's ``id``, ``type`` and ``name`` in its first
    delta and its ``arguments`` in the same or later ones."""

    def __init__(self, parser):
        self.parser = parser
        self.content = 0          # characters of content sent
        self.sent: list[int] = []  # per call sent: characters of its arguments sent

    @property
    def has_calls(self) -> bool:
        return bool(self.sent)

    def delta(self, text: str, finished: bool) -> dict:
        """The next delta of the choice whose text so far is ``text``."""
        parsed: Parsed = self.parser.parse(text, final=finished)
        delta, calls = {}, []
        if len(parsed.content) > self.content:
            delta["content"] = parsed.content[self.content:]
            self.content = len(parsed.content)
        for i, call in enumerate(parsed.calls):
            if i == len(self.sent):
                calls.append({"index": i, **call_body(call, new_call_id())})
                self.sent.append(len(call.arguments))
            elif len(call.arguments) > self.sent[i]:
                calls.append({"index": i, "function": {"arguments":
                                                       call.arguments[self.sent[i]:]}})
                self.sent[i] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        return delta


_HERMES_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
_SMOLLM2_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions.\nBased on the question, you will need to make one or more function/tool calls "
    "to achieve the purpose.\nIf none of the functions can be used, point it out and refuse to "
    "answer.\nIf the given question lacks the parameters required by the function, also point "
    "it out.\n\nYou have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be "
    "included.\nThe example format is as follows. Please make sure the parameter type is "
    "correct. If no function call is needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n{{\"name\": \"func_name1\", \"arguments\": {{\"argument1\": \"value1\", "
    "\"argument2\": \"value2\"}}}},\n... (more tool calls as required)\n]</tool_call>")

# ``--tool-call-parser``: the formats a model writes its calls in, by name.
PARSERS = {
    "hermes": TaggedJSON("hermes", _HERMES_PROMPT, "object"),
    "smollm2": TaggedJSON("smollm2", _SMOLLM2_PROMPT, "list"),
    "llama3_json": Llama3JSON(),
}
