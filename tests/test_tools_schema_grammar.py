"""A forced call's grammar follows the tool's whole parameter schema in every
tool syntax: random walks through llguidance's own mask (any text the grammar
allows, not what one model happens to write) parse back into arguments that
``jsonschema`` accepts; values the syntax can carry (``<``, newlines) are
allowed and read back unchanged; a keyword the grammar cannot enforce is
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import pytest

from turbospark import build_synthetic_install
from turbospark.server.tools import SYNTAXES, Tool
from turbospark.text import load_text

FAMILIES = {"qwen3_xml": "qwen_gdn", "gemma4": "gemma4", "qwen3_json": "qwen_gdn"}
WALKS = 12

# One schema per feature, each bounded so that every walk ends.
FEATURES: dict[str, dict] = {
    "string_bounds": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-c]+x", "maxLength": 6},
    "unanchored_pattern": {"type": "string", "pattern": "q[0-9]", "maxLength": 5},
    "enum": {"type": "string", "enum": ["red", "re<d>", "two\nlines"]},
    "const": {"const": "fixed"},
    "format_date": {"type": "string", "format": "date"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "format_ipv4": {"type": "string", "format": "ipv4"},
    "number_bounds": {"type": "number", "minimum": -1.5, "maximum": 2.25},
    "integer_bounds": {"type": "integer", "exclusiveMinimum": 5, "maximum": 800},
    "multiple_of": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 70},
    "boolean": {"type": "boolean"},
    "nullable": {"type": ["integer", "null"], "minimum": 0, "maximum": 3},
    "array_counts": {
        "type": "array",
        "items": {"type": "string", "maxLength": 2},
        "minItems": 2,
        "maxItems": 3,
    },
    "tuple": {
        "type": "array",
        "prefixItems": [{"type": "integer", "maximum": 9, "minimum": 0}, {"type": "boolean"}],
        "items": False,
        "minItems": 2,
    },
    "nested": {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {"deep": {"type": "string", "maxLength": 3}},
                "required": ["deep"],
                "additionalProperties": False,
            },
            "maybe": {"type": "integer", "minimum": 0, "maximum": 5},
        },
        "required": ["inner"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "string", "maxLength": 3},
            {"type": "integer", "minimum": 10, "maximum": 20},
        ]
    },
    "ref": {"$ref": "#/$defs/Point"},
}
DEFS = {
    "Point": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"],
        "additionalProperties": False,
    }
}


def parameters(value: dict) -> dict:
    """One required parameter of schema *value*, one optional bounded string, nothing else."""
    return {
        "type": "object",
        "properties": {"v": value, "note": {"type": "string", "maxLength": 3}},
        "required": ["v"],
        "additionalProperties": False,
        "$defs": DEFS,
    }


def tools_of(params: dict) -> list[Tool]:
    return [
        Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": params}})
    ]


@pytest.fixture(scope="module", params=list(FAMILIES))
def syntax(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def tokenizer(syntax: str, tmp_path_factory: pytest.TempPathFactory) -> llguidance.LLTokenizer:
    path: Path = tmp_path_factory.mktemp(syntax)
    build_synthetic_install(FAMILIES[syntax], path, vocab_size=160, num_layers=2, model_id="g")
    codec = load_text(path)
    return llguidance.LLTokenizer(codec.tokenizer.to_str(), eos_token=min(codec.eos_token_ids))


def walk(tokenizer: llguidance.LLTokenizer, grammar: str, rng: np.random.Generator) -> str:
    """Text the grammar allows: uniformly random allowed tokens until it is complete."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens: list[int] = []
    while not matcher.is_accepting():
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: tokenizer.vocab_size])
        assert len(allowed) and len(tokens) < 2000, tokenizer.decode_str(tokens)
        token = int(rng.choice(allowed))
        assert matcher.consume_token(token)
        tokens.append(token)
    return tokenizer.decode_str(tokens)


def accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in tokenizer.tokenize_str(text)) and (
        matcher.is_accepting()
    )


@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_allowed_call_validates(
    syntax: str, tokenizer: llguidance.LLTokenizer, feature: str
) -> None:
    params = parameters(FEATURES[feature])
    tools = tools_of(params)
    bound = SYNTAXES[syntax].bound(tools)
    grammar = bound.forced(tools, "required")
    rng = np.random.default_rng(sum(map(ord, feature)))
    for _ in range(WALKS):
        text = walk(tokenizer, grammar, rng)
        prose, calls = bound.parse(text)
        assert prose == "" and len(calls) == 1, text
        arguments = json.loads(calls[0].function.arguments)
        jsonschema.validate(arguments, params, format_checker=jsonschema.FormatChecker())


# A string the syntax writes raw, as the template writes it around the value.
RAW = {
    "qwen3_xml": (
        "<tool_call>\n<function=f>\n<parameter=v>\n{}\n</parameter>\n</function>\n</tool_call>"
    ),
    "gemma4": '<|tool_call>call:f{{v:<|"|>{}<|"|>}}<tool_call|>',
}
CARRIED = ["a<b", "two\nlines", "<tool_call>", "{x:1}", '"quoted"', "\n", ""]
NOT_CARRIED = {"qwen3_xml": "x</parameter>y", "gemma4": 'x<|"|>y'}


@pytest.mark.parametrize("value", CARRIED)
def test_raw_strings_carry_what_the_syntax_can(
    syntax: str, tokenizer: llguidance.LLTokenizer, value: str
) -> None:
    if syntax not in RAW:
        pytest.skip("JSON strings escape everything")
    params = parameters({"type": "string", "maxLength": 20})
    tools = tools_of(params)
    bound = SYNTAXES[syntax].bound(tools)
    text = RAW[syntax].format(value)
    assert accepts(tokenizer, bound.forced(tools, "required"), text)
    assert json.loads(bound.parse(text)[1][0].function.arguments) == {"v": value}


def test_a_raw_string_never_holds_its_closing_text(
    syntax: str, tokenizer: llguidance.LLTokenizer
) -> None:
    if syntax not in RAW:
        pytest.skip("JSON strings escape everything")
    tools = tools_of(parameters({"type": "string", "maxLength": 20}))
    grammar = SYNTAXES[syntax].forced(tools, "required")
    assert not accepts(tokenizer, grammar, RAW[syntax].format(NOT_CARRIED[syntax]))
    too_long = RAW[syntax].format("x" * 21)
    assert not accepts(tokenizer, grammar, too_long)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "properties": {"v": {"type": "string", "format": "color"}}}, "color"),
        (
            {"type": "object", "properties": {"v": {"type": "array", "uniqueItems": True}}},
            "uniqueItems",
        ),
        ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
        (
            {"type": "object", "properties": {"v": {"$ref": "#/$defs/Missing"}}, "required": ["v"]},
            "Missing",
        ),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(syntax: str, schema: dict, named: str) -> None:
    if syntax == "qwen3_json":
        pytest.skip("the JSON syntax is llguidance's own JSON Schema grammar")
    if syntax == "qwen3_xml" and named in ("uniqueItems", "Missing"):
        pytest.skip("a JSON-valued parameter is llguidance's to refuse (when compiled)")
    with pytest.raises(ValueError, match=named):
        SYNTAXES[syntax].forced(tools_of(schema), "required")
