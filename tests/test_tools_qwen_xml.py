"""Qwen3.5's XML tool-call syntax: what the synthetic qwen_gdn / qwen4_exp
templates render (the Qwen3.5 checkpoints' shape) parses back to the same
calls, whole and streamed in pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turbospark import build_synthetic_install
from turbospark.sdk import family_hooks
from turbospark.server.tools import (
    QWEN_XML_SYNTAX,
    StreamSplitter,
    Tool,
    ToolSyntax,
    parse_qwen_xml,
)
from turbospark.text import TextCodec, load_text

TOOLS = [
    Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "plan_trip",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "code": {"type": "string"},
                        "days": {"type": "integer"},
                        "budget": {"type": ["number", "null"]},
                        "flexible": {"type": "boolean"},
                        "stops": {"type": "array", "items": {"type": "string"}},
                        "hotel": {"type": "object"},
                        "note": {},
                    },
                },
            },
        }
    ),
    Tool.model_validate({"type": "function", "function": {"name": "now"}}),
]
CALLS = [
    (
        "plan_trip",
        {
            "city": "Paris",
            "code": "75",  # a string that reads as a number stays a string
            "days": 3,
            "budget": 120.5,
            "flexible": True,  # the template writes Python's True
            "stops": ["Lyon", "Dijon"],
            "hotel": {"stars": 4, "name": "Le Petit"},
            "note": "two\nlines",
        },
    ),
    ("now", {}),
]


@pytest.fixture(scope="module", params=["qwen_gdn", "qwen4_exp"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def codec(family: str, tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    path: Path = tmp_path_factory.mktemp(family)
    build_synthetic_install(family, path, vocab_size=160, num_layers=2, model_id="xml")
    return load_text(path)


def rendered_reply(codec: TextCodec, prose: str) -> str:
    """The assistant turn's text, as the template writes a reply that made CALLS."""
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(CALLS)
    ]
    ask = [{"role": "user", "content": "Plan it."}]
    tools = [t.model_dump(exclude_none=True) for t in TOOLS]
    # Thinking off: the prompt pre-fills the empty think block the reply's turn renders.
    before = codec.apply_chat_template(ask, tools=tools, enable_thinking=False)
    whole = codec.apply_chat_template(
        [*ask, {"role": "assistant", "content": prose, "tool_calls": calls}],
        tools=tools,
        add_generation_prompt=False,
        enable_thinking=False,
    )
    assert whole.startswith(before)
    return whole[len(before) :].removesuffix("<|im_end|>\n")


@pytest.mark.parametrize("prose", ["", "Let me plan that."])
def test_the_template_writes_the_xml_calls_and_they_parse_back(
    family: str, codec: TextCodec, prose: str
):
    name = family_hooks(family).turbospark_tool_syntax(chat_template=codec.chat_template)
    assert ToolSyntax.named(name) is QWEN_XML_SYNTAX
    assert "<function=" in codec.apply_chat_template([{"role": "user", "content": "hi"}], tools=[
        t.model_dump(exclude_none=True) for t in TOOLS
    ])  # fmt: skip
    text = rendered_reply(codec, prose)
    assert text.count("<tool_call>\n<function=") == 2
    said, calls = parse_qwen_xml(text, TOOLS)
    assert said == prose
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS

    for size in (1, 3, 7, len(text)):  # streamed: prose at once, the calls at the end
        splitter = StreamSplitter(QWEN_XML_SYNTAX.bound(TOOLS))
        sent = "".join(splitter.feed(text[i : i + size]) for i in range(0, len(text), size))
        tail, streamed = splitter.finish()
        assert (sent + tail).strip() == prose
        assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == CALLS


def test_untyped_values_read_as_json_and_malformed_blocks_stay_prose() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\nhi\n</parameter>\n</function>\n</tool_call>"
    _, calls = parse_qwen_xml(text)
    assert json.loads(calls[0].function.arguments) == {"n": 7, "s": "hi"}
    stray = "<tool_call>\n<function=f>\nnot a parameter\n</function>\n</tool_call>"
    assert parse_qwen_xml(stray) == (stray, [])
    json_form = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parse_qwen_xml(json_form) == (json_form, [])


@pytest.mark.parametrize("family", ["qwen_gdn", "qwen4_exp"])
def test_a_qwen3_style_template_gets_the_json_syntax(family: str) -> None:
    """The family reads its install's template: one without ``<function=``
    blocks (Qwen3's Hermes form) calls tools in JSON."""
    hermes = "{% for t in tools %}{{ t }}{% endfor %}<tool_call>{json}</tool_call>"
    assert family_hooks(family).turbospark_tool_syntax(chat_template=hermes) == "qwen3_json"
