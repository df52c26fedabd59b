"""Gemma 4's native tool-call syntax parsed into OpenAI ``tool_calls``."""

from __future__ import annotations

import json

import pytest

from turbospark.server.tools import gemma4_arguments, parse_gemma4

Q = '<|"|>'


def test_a_call_with_strings_numbers_and_nesting() -> None:
    text = (
        f"Let me check.<|tool_call>call:get_weather{{location:{Q}London, UK{Q},"
        f"days:3,scale:-1.5e2,metric:true,none:null,tags:[{Q}a{Q},2],"
        f"where:{{lat:51.5,note:{Q}{{not:json}}{Q}}}}}<tool_call|>"
    )
    prose, calls = parse_gemma4(text)
    assert prose == "Let me check."
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {
        "location": "London, UK",
        "days": 3,
        "scale": -150.0,
        "metric": True,
        "none": None,
        "tags": ["a", 2],
        "where": {"lat": 51.5, "note": "{not:json}"},
    }
    assert calls[0].id.startswith("call_")


def test_two_calls_and_empty_arguments() -> None:
    text = f"<|tool_call>call:a{{}}<tool_call|><|tool_call>call:b{{x:{Q}y{Q}}}<tool_call|>"
    prose, calls = parse_gemma4(text)
    assert prose == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("a", {}),
        ("b", {"x": "y"}),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        "<|tool_call>call:f{x:1<tool_call|>",
        f"<|tool_call>call:f{{x:{Q}open}}<tool_call|>",
        "<|tool_call>call:f{x:nope}<tool_call|>",
        "<|tool_call>call:f{1:2}<tool_call|>",
    ],
)
def test_a_malformed_block_stays_prose(bad: str) -> None:
    assert parse_gemma4(bad) == (bad, [])


def test_arguments_must_be_one_whole_object() -> None:
    with pytest.raises(ValueError):
        gemma4_arguments("{x:1}{y:2}")
    with pytest.raises(ValueError):
        gemma4_arguments("[1]")
