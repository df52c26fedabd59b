"""Tool calling: the request's tools, the model's tool-call blocks parsed back, and forcing a call.

The chat template renders ``tools`` in the family's own syntax; a template
that never mentions ``tools`` cannot, and a request with tools is refused for
it (never silently dropped). Three syntaxes (:data:`SYNTAXES`); the family names its
own (``turbospark_tool_syntax``, reading the install's template where its
checkpoints differ), and core never guesses one from the template's text:

- ``qwen3_xml``: Qwen3.5's (and Qwen3-Coder's) XML form, which the real Qwen3.5 checkpoints'
  ``chat_template`` writes and the synthetic qwen_gdn / qwen4_exp templates
  copy: ``<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n
  </function>\n</tool_call>``, a string value written raw and any other value
  as JSON; values are read back by the tool's parameter types, as vLLM's
  ``qwen3_coder`` parser reads them;
- ``qwen3_json``: Qwen3's (Hermes-style) JSON-in-``<tool_call>`` blocks
  (``{"name": ..., "arguments": ...}``), the default for a family that names none;
- ``gemma4``: Gemma 4's native ``<|tool_call>call:NAME{...}<tool_call|>``.

``tool_choice: "required"`` or a named function is enforced with an
llguidance grammar in the install's syntax: the reply is one block naming an
allowed function whose arguments match its parameter schema.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from turbospark.server.tool_grammars import (
    GEMMA4_KEY,
    GEMMA4_QUOTE,
    Gemma4Rules,
    QwenXmlRules,
    gemma4_call_rule,
    schema_type,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        """Templates expect the arguments as an object (they ``tojson`` it)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


class ToolCallDelta(ToolCall):
    index: int


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """The reply's prose and its well-formed tool calls. A block that is not a
    JSON object with a ``name`` stays in the prose (nothing is lost)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _BLOCK.finditer(text):
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        calls.append(
            ToolCall(
                id=new_call_id(), function=FunctionCall(name=name, arguments=json.dumps(arguments))
            )
        )
    kept.append(text[at:])
    return "".join(kept).strip() if calls else text, calls


class StreamSplitter:
    """Streamed text split into prose (sent at once) and tool-call text (held
    until the end, then parsed): a tail that may be the start of ``<tool_call>``
    is held back until the next piece decides."""

    def __init__(self, syntax: ToolSyntax | None = None) -> None:
        self.held = ""
        self.calling = False
        self.syntax = syntax or QWEN_JSON_SYNTAX

    def feed(self, text: str) -> str:
        if self.calling:
            self.held += text
            return ""
        self.held += text
        opening = self.syntax.open
        start = self.held.find(opening)
        if start >= 0:
            self.calling = True
            prose, self.held = self.held[:start], self.held[start:]
            return prose
        keep = next(
            (
                k
                for k in range(min(len(opening) - 1, len(self.held)), 0, -1)
                if opening.startswith(self.held[-k:])
            ),
            0,
        )
        prose, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return prose

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What was held: trailing prose, and the calls it parses into."""
        prose, calls = self.syntax.parse(self.held)
        return ("" if calls else prose), calls


def forced_grammar(tools: list[Tool], choice: ToolChoice | None) -> str | None:
    """A Lark grammar (llguidance) for one forced call, or None when the model may choose."""
    if choice in (None, "none", "auto"):
        return None
    options = []
    for tool in _allowed(tools, choice):
        parameters = tool.function.parameters
        # The tool's definitions move to the call object's root, where its
        # ``#/$defs/...`` references resolve once the parameters sit under "arguments".
        defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
        call = {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            **defs,
            "x-guidance": {"whitespace_flexible": False},
        }
        options.append(f"%json {json.dumps(call)}")
    return f'start: "{OPEN}\\n" ({" | ".join(options)}) "\\n{CLOSE}"'


def check_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """Why *choice* cannot be honoured with *tools* (None when it can)."""
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools or []]
        if choice.function.name not in names:
            return f"tool_choice names '{choice.function.name}', which is not in tools ({names})"
    elif choice == "required" and not tools:
        return "tool_choice 'required' needs tools"
    return None


# -- Qwen3.5's XML syntax -------------------------------------------------------------
#
# As the Qwen3.5 checkpoints' chat_template writes an assistant's tool_calls (and
# Qwen3-Coder's before it; vLLM and SGLang read it with their ``qwen3_coder`` parser):
#
#   <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>
#
# a string VALUE raw, a mapping or a list as JSON, any other scalar as Python's
# ``str`` (so ``True``); several calls are several blocks.

QWEN_XML_FUNCTION = "<function="
_XML_BLOCK = re.compile(
    r"<tool_call>\s*<function=([^>\n]{1,64})>\n?(.*?)</function>\s*</tool_call>", re.DOTALL
)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]{1,128})>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


def _xml_value(text: str, schema: Any) -> Any:
    """One parameter's text as its schema's type (vLLM's ``qwen3_coder`` reading):
    a string stays text, a boolean may be Python's ``True``; anything else is read
    as JSON, and text that is not JSON stays text (nothing is lost)."""
    kind = schema_type(schema)
    if kind == "string":
        return text
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def parse_qwen_xml(text: str, tools: Sequence[Tool] = ()) -> tuple[str, list[ToolCall]]:
    """As :func:`parse`, for Qwen3.5's ``<tool_call><function=...>`` blocks; each
    value is read by its parameter's type in *tools* (untyped: JSON if it parses)."""
    params = {t.function.name: t.function.parameters.get("properties") or {} for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _XML_BLOCK.finditer(text):
        name, body = match.group(1).strip(), match.group(2)
        if _XML_PARAMETER.sub("", body).strip():  # text outside the parameters: not a call
            continue
        schemas = params.get(name, {})
        arguments = {
            m.group(1).strip(): _xml_value(m.group(2), schemas.get(m.group(1).strip()))
            for m in _XML_PARAMETER.finditer(body)
        }
        kept.append(text[at : match.start()])
        at = match.end()
        function = FunctionCall(name=name, arguments=json.dumps(arguments))
        calls.append(ToolCall(id=new_call_id(), function=function))
    kept.append(text[at:])
    return "".join(kept).strip() if calls else text, calls


def forced_qwen_xml_grammar(tools: list[Tool], choice: ToolChoice | None) -> str | None:
    """As :func:`forced_grammar`, in Qwen3.5's XML syntax: one call of an allowed
    function, its parameters following the schema (:class:`QwenXmlRules`).
    ValueError names a schema part the grammar cannot enforce."""
    if choice in (None, "none", "auto"):
        return None
    rules = QwenXmlRules()
    calls = " | ".join(
        rules.call(t.function.name, t.function.parameters) for t in _allowed(tools, choice)
    )
    head = f"start: {json.dumps(OPEN + chr(10) + QWEN_XML_FUNCTION)} ({calls}) "
    head += json.dumps("</function>\n" + CLOSE)
    return "\n".join([head, *rules.rules])


def _allowed(tools: list[Tool], choice: ToolChoice | None) -> list[Tool]:
    """The tools a forced *choice* lets the model call."""
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return tools


# -- Gemma 4's native syntax ----------------------------------------------------------
#
# Based on Google's "Function calling with Gemma 4" guide
# (ai.google.dev/gemma/docs/capabilities/text/function-calling-gemma4), as quoted by
# third-party notes: a call is ``<|tool_call>call:NAME{key:value,...}<tool_call|>``,
# keys are bare, every string is wrapped in ``<|"|>`` and other values are written as
# JSON scalars, objects ``{...}`` and lists ``[...]``.

GEMMA4_OPEN, GEMMA4_CLOSE = "<|tool_call>", "<tool_call|>"
_GEMMA4_BLOCK = re.compile(
    r"<\|tool_call>call:([A-Za-z0-9_.-]{1,64})(\{.*?\})<tool_call\|>", re.DOTALL
)
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null")
_KEY = re.compile(GEMMA4_KEY)


class _Gemma4Args:
    """A recursive-descent reader of one call's ``{...}`` argument object."""

    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def value(self) -> Any:
        text = self.text
        if text.startswith(GEMMA4_QUOTE, self.at):
            start = self.at + len(GEMMA4_QUOTE)
            end = text.find(GEMMA4_QUOTE, start)
            if end < 0:
                raise ValueError("an unterminated string")
            self.at = end + len(GEMMA4_QUOTE)
            return text[start:end]
        if text.startswith("{", self.at):
            return self.collection("{", "}", keyed=True)
        if text.startswith("[", self.at):
            return self.collection("[", "]", keyed=False)
        match = _SCALAR.match(text, self.at)
        if match is None:
            raise ValueError(f"no value at {self.at}")
        self.at = match.end()
        return json.loads(match.group())

    def collection(self, open_: str, close: str, keyed: bool) -> Any:
        self.at += len(open_)
        items: Any = {} if keyed else []
        if self.text.startswith(close, self.at):
            self.at += 1
            return items
        while True:
            if keyed:
                key = _KEY.match(self.text, self.at)
                if key is None or not self.text.startswith(":", key.end()):
                    raise ValueError(f"no key at {self.at}")
                self.at = key.end() + 1
                items[key.group()] = self.value()
            else:
                items.append(self.value())
            if self.text.startswith(",", self.at):
                self.at += 1
            elif self.text.startswith(close, self.at):
                self.at += 1
                return items
            else:
                raise ValueError(f"expected ',' or '{close}' at {self.at}")


def gemma4_arguments(text: str) -> dict[str, Any]:
    """``{key:<|"|>v<|"|>,n:1}`` as a dict; ValueError when it is not one whole object."""
    reader = _Gemma4Args(text)
    if not text.startswith("{"):
        raise ValueError("the arguments are not an object")
    value = reader.collection("{", "}", keyed=True)
    if reader.at != len(text):
        raise ValueError("text after the arguments")
    return value


def parse_gemma4(text: str) -> tuple[str, list[ToolCall]]:
    """As :func:`parse`, for Gemma 4's ``<|tool_call>call:...<tool_call|>`` blocks."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for match in _GEMMA4_BLOCK.finditer(text):
        try:
            arguments = gemma4_arguments(match.group(2))
        except ValueError:
            continue
        kept.append(text[at : match.start()])
        at = match.end()
        function = FunctionCall(name=match.group(1), arguments=json.dumps(arguments))
        calls.append(ToolCall(id=new_call_id(), function=function))
    kept.append(text[at:])
    return "".join(kept).strip() if calls else text, calls


def forced_gemma4_grammar(tools: list[Tool], choice: ToolChoice | None) -> str | None:
    """As :func:`forced_grammar`, in Gemma 4's syntax: one call of an allowed
    function, its arguments following the schema (:class:`Gemma4Rules`), every
    string one the parser reads back unchanged. ValueError names a schema part
    the grammar cannot enforce."""
    if choice in (None, "none", "auto"):
        return None
    rules = Gemma4Rules()
    calls = [
        gemma4_call_rule(rules, t.function.name, t.function.parameters)
        for t in _allowed(tools, choice)
    ]
    call = rules.rule(" | ".join(calls))
    head = f"start: {json.dumps(GEMMA4_OPEN + 'call:')} {call} {json.dumps(GEMMA4_CLOSE)}"
    return "\n".join([head, *rules.all_rules()])


@dataclass(frozen=True)
class ToolSyntax:
    """How one chat template's tool calls look: where a call starts, how the
    reply's calls are parsed (given the request's tools), and the grammar that
    forces one."""

    open: str
    parse_with: Callable[[str, Sequence[Tool]], tuple[str, list[ToolCall]]]
    forced: Callable[[list[Tool], ToolChoice | None], str | None]
    tools: tuple[Tool, ...] = ()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply's prose and its well-formed calls (read with the bound tools' types)."""
        return self.parse_with(text, self.tools)

    def bound(self, tools: Sequence[Tool]) -> ToolSyntax:
        """This syntax for one request: its replies are read with *tools*' parameter types."""
        return dataclasses.replace(self, tools=tuple(tools))

    @staticmethod
    def named(name: str) -> ToolSyntax:
        """The syntax a family names (``turbospark_tool_syntax``; the runner has
        refused a name not here)."""
        return SYNTAXES[name]


def _untyped(parse_: Callable[[str], tuple[str, list[ToolCall]]]) -> Callable[..., Any]:
    """A parser whose syntax carries its own value types (JSON, Gemma 4's)."""

    @functools.wraps(parse_)
    def parse_with(text: str, tools: Sequence[Tool]) -> tuple[str, list[ToolCall]]:
        return parse_(text)

    return parse_with


QWEN_JSON_SYNTAX = ToolSyntax(OPEN, _untyped(parse), forced_grammar)
QWEN_XML_SYNTAX = ToolSyntax(OPEN, parse_qwen_xml, forced_qwen_xml_grammar)
GEMMA4_SYNTAX = ToolSyntax(GEMMA4_OPEN, _untyped(parse_gemma4), forced_gemma4_grammar)
# The names of turbospark.contract.hookspecs.TOOL_SYNTAXES -> how each is read and forced.
SYNTAXES = {"qwen3_json": QWEN_JSON_SYNTAX, "qwen3_xml": QWEN_XML_SYNTAX, "gemma4": GEMMA4_SYNTAX}
