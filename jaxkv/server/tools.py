"""Tool calling's requests on ``/v1/chat/completions``: ``tools`` and ``tool_choice`` checked and
turned into a plan (the grammar that enforces ``required`` and named calls, the parser that
reads ``auto`` calls) and the conversation rendered with its tools. The answer's side is
jaxkv/server/tool_calls.py.

Design notes: docs/server.md."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jinja2
import jinja2.meta

from jaxkv.sample.structured import StructuredOutputsParams
from jaxkv.server.protocol import FieldError
from jaxkv.server.tool_calls import PARSERS, NamedArguments, RequiredArray, ToolCall

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")        # OpenAI's rule for a function name
_CHOICES = ("none", "auto", "required")
# The format tools are written in for a chat template that does not render them, when the
# server has no --tool-call-parser.
_DEFAULT_FORMAT = "hermes"


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for.

    Attributes:
      tools: the request's tools, checked (OpenAI's ``{"type": "function", "function": ...}``).
      choice: ``none``, ``auto``, ``required`` or ``named``.
      parser: what reads the answer's calls (None: the answer is content).
      constraint: the grammar ``required`` and named calls are enforced by.
    """

    tools: tuple[dict, ...]
    choice: str
    parser: Any
    constraint: StructuredOutputsParams | None


def plan(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None,
         parser_name: str | None) -> ToolPlan | None:
    """The plan of a request's ``tools`` / ``tool_choice`` (None: no tools, nothing to do);
    ``tool_choice`` defaults to ``auto`` with tools, as OpenAI's.

    Raises:
      FieldError: naming ``tools[i]...`` or ``tool_choice``: a malformed tool, a name given
        twice, a choice naming an absent tool or given without tools, ``auto`` on a server
        without ``--tool-call-parser``.
    """
    tools = _checked_tools(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    named = _named_choice(tool_choice)
    if not tools:
        if tool_choice != "none":
            raise FieldError("tool_choice", f"tool_choice={json.dumps(tool_choice)} needs tools")
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if named is not None:
        if named not in functions:
            raise FieldError("tool_choice", f"tool_choice names the function {named!r}, which "
                                            f"is not among tools ({', '.join(functions)})")
        schema = functions[named].get("parameters") or {"type": "object"}
        return ToolPlan(tools, "named", NamedArguments(named), _compact(schema))
    if tool_choice == "required":
        return ToolPlan(tools, "required", RequiredArray(),
                        _compact(required_schema(tools, parallel_tool_calls)))
    if tool_choice == "auto" and parser_name is None:
        raise FieldError("tool_choice", "tool_choice=\"auto\" reads the calls from the model's "
                                        "text: start the server with --tool-call-parser "
                                        f"({', '.join(PARSERS)})")
    return ToolPlan(tools, tool_choice, PARSERS[parser_name] if tool_choice == "auto" else None,
                    None)


def _checked_tools(tools: Any) -> tuple[dict, ...]:
    """The tools, each ``{"type": "function", "function": {"name", "description"?,
    "parameters"?: {...}}}``; names unique."""
    if not isinstance(tools, list):
        raise FieldError("tools", "tools must be a list of {\"type\": \"function\", "
                                  "\"function\": {...}}")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise FieldError(f"{where}.type", f"{where}.type must be \"function\"")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise FieldError(f"{where}.function", f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise FieldError(f"{where}.function.name", f"{where}.function.name={name!r}: give "
                             "1-64 letters, digits, underscores or dashes")
        if name in seen:
            raise FieldError(f"{where}.function.name", f"{where}.function.name={name!r} is "
                                                       "given twice")
        seen.add(name)
        if not isinstance(fn.get("parameters", {}), dict):
            raise FieldError(f"{where}.function.parameters",
                             f"{where}.function.parameters must be a JSON schema object")
    return tuple(tools)


def _named_choice(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` names (None for none/auto/required)."""
    if isinstance(tool_choice, str) and tool_choice in _CHOICES:
        return None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(fn, dict) or tool_choice.get("type") != "function"
            or not isinstance(fn.get("name"), str)):
        raise FieldError("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" "
                                        "or {\"type\": \"function\", \"function\": {\"name\": "
                                        "...}}")
    return fn["name"]


def required_schema(tools: tuple[dict, ...], parallel_tool_calls: bool | None) -> dict:
    """vLLM's schema of ``tool_choice="required"``: a non-empty array of ``{"name": <a tool>,
    "parameters": <its schema>}`` (one at most when ``parallel_tool_calls`` is false), the
    tools' ``$defs`` merged at the root where their ``$ref``s point."""
    defs, items = {}, []
    for tool in tools:
        params = dict(tool["function"].get("parameters") or {"type": "object"})
        defs.update(params.pop("$defs", {}))
        items.append({"properties": {"name": {"type": "string",
                                              "enum": [tool["function"]["name"]]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _compact(schema: dict) -> StructuredOutputsParams:
    """A call's grammar: its JSON without optional whitespace, as OpenAI writes arguments."""
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


# ---------------------------------------------------------------------- the prompt


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (else the server writes them)."""
    if template is None:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))


def render(tool_plan: ToolPlan | None, messages: list[dict], renders_tools: bool,
           parser_name: str | None) -> tuple[list[dict], dict]:
    """The conversation and template variables of a chat request with tools.

    A template that renders tools gets them as ``tools`` and the turns as given (an earlier
    call's ``arguments`` decoded to an object, as vLLM passes them). For one that does not,
    the tools are described in the system message, earlier calls written into the assistant
    turns and tool results into user turns, in the format of ``--tool-call-parser`` (Hermes's
    without one).

    Raises:
      FieldError: an earlier call's arguments that are not JSON, naming the message.
    """
    messages = [_decoded_arguments(m, i) for i, m in enumerate(messages)]
    if renders_tools:
        return messages, ({"tools": list(tool_plan.tools)} if tool_plan else {})
    fmt = PARSERS[parser_name or _DEFAULT_FORMAT]
    out = []
    for m in messages:
        if m["role"] == "tool":
            m = {"role": "user", "content": fmt.render_result(m["content"])}
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], json.dumps(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            text = (m.get("content") or "") + fmt.render_calls(calls)
            m = {"role": "assistant", "content": text}
        out.append(m)
    if tool_plan is not None and tool_plan.choice != "none":
        prompt = fmt.system_prompt(list(tool_plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _decoded_arguments(message: dict, index: int) -> dict:
    """An assistant turn with its calls' ``arguments`` JSON text decoded."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    decoded = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError(where, f"{where} must be {{\"type\": \"function\", \"function\": "
                                    "{\"name\": ..., \"arguments\": ...}}")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise FieldError(f"{where}.function.arguments",
                             f"{where}.function.arguments is not JSON") from None
        decoded.append({**call, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": decoded}
