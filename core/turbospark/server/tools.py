"""Tool calling: the request's tools, the model's ``<tool_call>`` blocks parsed back, and forcing a call.

The chat template renders ``tools`` in the family's own syntax; a template
that never mentions ``tools`` cannot, and a request with tools is refused for
it (never silently dropped). Two syntaxes (:class:`ToolSyntax`, picked from
the template): the JSON-in-``<tool_call>`` blocks of Qwen's templates, and
Gemma 4's native ``<|tool_call>call:NAME{...}<tool_call|>`` (the synthetic
gemma4 template writes it).
``tool_choice: "required"`` or a named function is enforced with an
llguidance grammar: the reply is one block whose JSON names an allowed
function and whose arguments match its parameter schema.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
        self.syntax = syntax or QWEN_SYNTAX

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
    allowed = tools
    if isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools if t.function.name == choice.function.name]
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in allowed
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    body = json.dumps(schema | {"x-guidance": {"whitespace_flexible": False}})
    return f'start: "{OPEN}\\n" %json {body} "\\n{CLOSE}"'


def check_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> str | None:
    """Why *choice* cannot be honoured with *tools* (None when it can)."""
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools or []]
        if choice.function.name not in names:
            return f"tool_choice names '{choice.function.name}', which is not in tools ({names})"
    elif choice == "required" and not tools:
        return "tool_choice 'required' needs tools"
    return None


# -- Gemma 4's native syntax ----------------------------------------------------------
#
# Based on Google's "Function calling with Gemma 4" guide
# (ai.google.dev/gemma/docs/capabilities/text/function-calling-gemma4), as quoted by
# third-party notes: a call is ``<|tool_call>call:NAME{key:value,...}<tool_call|>``,
# keys are bare, every string is wrapped in ``<|"|>`` and other values are written as
# JSON scalars, objects ``{...}`` and lists ``[...]``.

GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_GEMMA4_BLOCK = re.compile(
    r"<\|tool_call>call:([A-Za-z0-9_.-]{1,64})(\{.*?\})<tool_call\|>", re.DOTALL
)
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


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


class _Gemma4Grammar:
    """A Lark grammar (llguidance) for Gemma 4 argument objects, following the
    common parts of a JSON schema: ``properties`` (the required ones, in order,
    then none of the optional ones), ``enum``/``const``, and the ``type`` of
    strings, integers (a small ``minimum``..``maximum`` range exactly), numbers, booleans, null, arrays and objects. Anything
    else is any well-formed value."""

    GENERIC = (
        'value: string | NUMBER | "true" | "false" | "null" | object | list',
        'object: "{" (pair ("," pair)*)? "}"',
        'pair: KEY ":" value',
        'list: "[" (value ("," value)*)? "]"',
        f"string: {json.dumps(GEMMA4_QUOTE)} TEXT? {json.dumps(GEMMA4_QUOTE)}",
        "TEXT: /([^<]|<[^|])+/",
        "KEY: /[A-Za-z_][A-Za-z0-9_]*/",
        "NUMBER: /-?(0|[1-9][0-9]{0,14})(\\.[0-9]{1,15})?/",
        "INTEGER: /-?(0|[1-9][0-9]{0,14})/",
    )

    def __init__(self) -> None:
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def literal(self, value: Any) -> str:
        if isinstance(value, str):
            return json.dumps(GEMMA4_QUOTE + value + GEMMA4_QUOTE)
        return json.dumps(json.dumps(value))  # numbers, booleans, null as written

    def schema(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "value"
        if "const" in schema:
            return self.rule(self.literal(schema["const"]))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            if all(isinstance(v, str | int | float | bool) or v is None for v in schema["enum"]):
                return self.rule(" | ".join(self.literal(v) for v in schema["enum"]))
            return "value"
        kind = schema.get("type")
        if kind == "string":
            return "string"
        if kind == "integer":
            low, high = schema.get("minimum"), schema.get("maximum")
            if isinstance(low, int) and isinstance(high, int) and 0 <= high - low <= 100:
                return self.rule(" | ".join(self.literal(v) for v in range(low, high + 1)))
            return "INTEGER"
        if kind == "number":
            return "NUMBER"
        if kind == "boolean":
            return self.rule('"true" | "false"')
        if kind == "null":
            return self.rule('"null"')
        if kind == "array":
            item = self.schema(schema.get("items"))
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" or "properties" in schema:
            return self.object(schema)
        return "value"

    def object(self, schema: dict[str, Any]) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return "object"
        required = [k for k in schema.get("required", []) if k in properties]
        if not all(_KEY.fullmatch(k) for k in required):
            return "object"
        pairs = [f"{json.dumps(k + ':')} {self.schema(properties[k])}" for k in required]
        return self.rule('"{" ' + ' "," '.join(pairs) + ' "}"')


def forced_gemma4_grammar(tools: list[Tool], choice: ToolChoice | None) -> str | None:
    """As :func:`forced_grammar`, in Gemma 4's syntax: one call of an allowed
    function, its arguments following the parameter schema as far as
    :class:`_Gemma4Grammar` reads it."""
    if choice in (None, "none", "auto"):
        return None
    allowed = tools
    if isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools if t.function.name == choice.function.name]
    grammar = _Gemma4Grammar()
    calls = [
        f"{json.dumps(t.function.name)} {grammar.schema(t.function.parameters)}" for t in allowed
    ]
    call = grammar.rule(" | ".join(calls))
    head = f"start: {json.dumps(GEMMA4_OPEN + 'call:')} {call} {json.dumps(GEMMA4_CLOSE)}"
    return "\n".join([head, *grammar.rules, *_Gemma4Grammar.GENERIC])


@dataclass(frozen=True)
class ToolSyntax:
    """How one chat template's tool calls look: where a call starts, how the
    reply's calls are parsed, and the grammar that forces one."""

    open: str
    parse: Callable[[str], tuple[str, list[ToolCall]]]
    forced: Callable[[list[Tool], ToolChoice | None], str | None]

    @staticmethod
    def of(chat_template: str | None) -> ToolSyntax:
        """Gemma 4's syntax when the template writes it, else Qwen's ``<tool_call>`` JSON."""
        if GEMMA4_OPEN in (chat_template or ""):
            return GEMMA4_SYNTAX
        return QWEN_SYNTAX


QWEN_SYNTAX = ToolSyntax(OPEN, parse, forced_grammar)
GEMMA4_SYNTAX = ToolSyntax(GEMMA4_OPEN, parse_gemma4, forced_gemma4_grammar)
