"""Tool calling: the request's tools, the model's ``<tool_call>`` blocks parsed back, and forcing a call.

The chat template renders ``tools`` in the family's own syntax; a template
that never mentions ``tools`` cannot, and a request with tools is refused for
it (never silently dropped). The parser reads the JSON-in-``<tool_call>``
blocks of Qwen's templates (the synthetic Qwen installs ship that shape).
``tool_choice: "required"`` or a named function is enforced with an
llguidance grammar: the reply is one block whose JSON names an allowed
function and whose arguments match its parameter schema.
"""

from __future__ import annotations

import json
import re
import uuid
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

    def __init__(self) -> None:
        self.held = ""
        self.calling = False

    def feed(self, text: str) -> str:
        if self.calling:
            self.held += text
            return ""
        self.held += text
        start = self.held.find(OPEN)
        if start >= 0:
            self.calling = True
            prose, self.held = self.held[:start], self.held[start:]
            return prose
        keep = next(
            (
                k
                for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                if OPEN.startswith(self.held[-k:])
            ),
            0,
        )
        prose, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return prose

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What was held: trailing prose, and the calls it parses into."""
        prose, calls = parse(self.held)
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
