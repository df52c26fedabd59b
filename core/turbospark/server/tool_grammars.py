"""A tool's parameter schema as Lark rules (llguidance) inside a family's tool-call syntax.

A forced call must follow the tool's JSON Schema as strictly as
``response_format`` does. Wherever a syntax writes a value as JSON (Qwen3.5's
non-string parameters, Gemma 4's numbers, booleans and null), the value is
llguidance's own ``%json`` sub-grammar of that sub-schema, so bounds,
``multipleOf``, ``anyOf``, ``$ref`` and the rest are enforced by the same code
as ``response_format``. What a syntax writes in a shape of its own is composed
here from the schema:

- a **raw string** (Qwen3.5's string parameters; Gemma 4's ``<|"|>``-quoted
  strings) is one lexeme: the intersection of its length bounds, its
  ``pattern`` (searched, as JSON Schema reads it), its ``format`` and what the
  syntax can carry (never its own closing delimiter, so the parser reads back
  exactly the text the grammar allowed), or its ``enum``/``const`` values;
- Gemma 4's **objects and lists** (bare keys, no JSON quoting) follow
  ``properties`` in their order, ``required``, ``additionalProperties``,
  ``items``, ``prefixItems`` and ``minItems``/``maxItems``, with ``anyOf``,
  ``oneOf``, ``allOf`` (merged), ``$ref`` and type lists as alternatives.

A keyword neither path can enforce is refused by name (``ValueError``, a 400
naming ``tools``), never silently ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

# Compact JSON: free whitespace lets a model loop on it.
COMPACT = {"whitespace_flexible": False}
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
     "readOnly", "writeOnly", "$defs", "definitions", "strict", "discriminator"}
)  # fmt: skip
STRING_KEYS = frozenset({"type", "minLength", "maxLength", "pattern", "format", "enum", "const"})
# A JSON value Gemma 4's syntax carries outside its own strings, objects and lists.
SCALAR_KEYS = frozenset(
    {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"})
ARRAY_KEYS = frozenset({"type", "items", "prefixItems", "minItems", "maxItems"})

_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_DATE = (
    r"[1-9][0-9]{3}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])"
    r"|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"
)
_TIME = (
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
    r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
# The formats llguidance enforces in JSON strings, as raw text: each regex allows
# only valid values (a subset where the whole grammar would be long: ISO
# durations with days, IPv6 written in full, no leap day).
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "duration": r"P(?:[0-9]{1,4}Y)?(?:[0-9]{1,4}M)?[0-9]{1,4}D(?:T[0-9]{1,4}H)?",
    "email": rf"[A-Za-z0-9_%+-]{{1,32}}(?:\.[A-Za-z0-9_%+-]{{1,32}}){{0,3}}@{_LABEL}(?:\.{_LABEL}){{0,3}}\.[A-Za-z]{{2,24}}",
    "hostname": rf"{_LABEL}(?:\.{_LABEL}){{0,3}}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "ipv6": r"[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){7}",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]{0,15}://[A-Za-z0-9._~%!$&'()*+,;=:@/?-]{1,200}",
}


def lark_regex(regex: str) -> str:
    """*regex* as a Lark ``/.../`` literal."""
    return "/" + regex.replace("/", "\\/") + "/"


def searched(pattern: str) -> str:
    """A JSON Schema ``pattern`` (found anywhere in the string, unless it is
    anchored with ``^``/``$``) as a regex the whole string must match."""
    start = pattern.startswith("^")
    body = pattern[1:] if start else pattern
    end = body.endswith("$") and not body.endswith("\\$")
    body = body[:-1] if end else body
    anywhere = "(?s:.*)"
    return ("" if start else anywhere) + f"(?:{body})" + ("" if end else anywhere)


def literal(text: str) -> str:
    """*text* as a Lark string literal."""
    return json.dumps(text)


class SchemaRules:
    """The rules of one forced-call grammar, and the schema reading every syntax
    shares: ``$ref`` resolution, merged ``allOf``, refusals by name.

    *forbidden* are the texts a raw string of this syntax cannot contain (its
    closing delimiter: the parser ends the string at the first one)."""

    def __init__(self, syntax: str, forbidden: Iterable[str]) -> None:
        self.syntax, self.forbidden = syntax, tuple(forbidden)
        self.root: dict[str, Any] = {}
        self.tool = ""
        self.rules: list[str] = []
        self.named: dict[str, str] = {}  # a $ref -> its rule, for the current tool

    def start_tool(self, tool: str, root: dict[str, Any]) -> None:
        """Read *tool*'s schema next (its ``$ref``s resolve in *root*)."""
        self.tool, self.root, self.named = tool, root, {}

    def rule(self, body: str, options: str = "") -> str:
        name = f"t{len(self.rules)}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def reserve(self) -> tuple[str, int]:
        """A rule's name before its body (a ``$ref`` may refer to itself)."""
        self.rules.append("")
        return f"t{len(self.rules) - 1}", len(self.rules) - 1

    def fill(self, at: int, body: str) -> None:
        self.rules[at] = f"t{at}: {body}"

    def refuse(self, what: str) -> ValueError:
        return ValueError(
            f"tools: the parameters of '{self.tool}' {what}, which a forced call in the "
            f"{self.syntax} tool syntax cannot enforce; simplify that part of the schema"
        )

    def resolve(self, ref: str) -> Any:
        """A local ``$ref`` (``#/$defs/X``, ``#/definitions/X``, any JSON pointer in the tool)."""
        if not ref.startswith("#"):
            raise self.refuse(f"refer to '{ref}' (only references within the schema are read)")
        node: Any = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise self.refuse(f"refer to '{ref}', which is not in the schema")
            node = node[part]
        return node

    def merged(self, schema: dict[str, Any]) -> dict[str, Any]:
        """*schema* with ``allOf`` folded in (properties and required joined) and a
        ``$ref`` with siblings merged, so one dict says everything."""
        out = {k: v for k, v in schema.items() if k not in ("allOf", "$ref")}
        parts = list(schema.get("allOf") or [])
        if "$ref" in schema and len(schema) > 1:
            parts.insert(0, self.resolve(schema["$ref"]))
        for part in parts:
            if part is True:
                continue
            if not isinstance(part, dict):
                raise self.refuse("have an allOf part that no value satisfies")
            part = self.merged(part)
            for key, value in part.items():
                if key == "properties":
                    out["properties"] = {**value, **out.get("properties", {})}
                elif key == "required":
                    out["required"] = [*out.get("required", []), *value]
                else:
                    out.setdefault(key, value)
        return out

    def embedded(self, schema: Any) -> str:
        """A sub-schema as llguidance's own ``%json`` grammar, the tool's
        definitions carried along so its ``$ref``s resolve."""
        body = schema if isinstance(schema, dict) else {}
        if schema is False:
            raise self.refuse("allow no value somewhere (false)")
        for defs in ("$defs", "definitions"):
            if defs in self.root and defs not in body:
                body = {**body, defs: self.root[defs]}
        return self.rule(f"%json {json.dumps({**body, 'x-guidance': COMPACT})}")

    def raw_string(self, schema: dict[str, Any], suffix: str) -> str:
        """A string written unquoted up to *suffix* (the syntax's closing text),
        as one lexeme following the string keywords of *schema*."""
        self.only(schema, STRING_KEYS, "a string")
        forbidden = " | ".join(lark_regex(f"(?s:.*){re.escape(f)}(?s:.*)") for f in self.forbidden)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else list(schema["enum"])
            texts = [v for v in values if isinstance(v, str)]
            texts = [t for t in texts if not any(f in t for f in self.forbidden)]
            if not texts:
                raise self.refuse("allow no string this syntax can write in an enum or const")
            terminal = " | ".join(literal(t) for t in texts)
        else:
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            parts = [lark_regex(f"(?s:.{{{low},{'' if high is None else high}}})")]
            if "pattern" in schema:
                parts.append(lark_regex(searched(schema["pattern"])))
            if "format" in schema:
                if schema["format"] not in FORMATS:
                    raise self.refuse(
                        f"use the string format '{schema['format']}' (known: "
                        f"{', '.join(sorted(FORMATS))})"
                    )
                parts.append(lark_regex(FORMATS[schema["format"]]))
            if forbidden:
                parts.append(f"~({forbidden})")
            terminal = " & ".join(parts)
        name = f"S{len(self.rules)}"
        self.rules.append(f"{name}: {terminal}")
        return self.rule(name, f"[suffix={literal(suffix)}]")

    def members(
        self, schema: dict[str, Any], pattern: str, what: str, why: str
    ) -> tuple[list[tuple[str, Any, bool]], Any]:
        """An object's keys the syntax can write, as ``(key, schema, required)``
        (a required key named only by ``required`` takes ``additionalProperties``),
        and its ``additionalProperties``; an optional key the syntax cannot write
        is left out, a required one refused."""
        properties = schema.get("properties") or {}
        required = list(dict.fromkeys(schema.get("required") or []))
        extra = schema.get("additionalProperties", True)
        members = [(k, s, k in required) for k, s in properties.items()]
        for key in required:
            if key not in properties:
                if extra is False:
                    raise self.refuse(f"require '{key}', which additionalProperties forbids")
                members.append((key, extra, True))
        kept = []
        for key, sub, need in members:
            if re.fullmatch(pattern, key) is None:
                if need:
                    raise self.refuse(f"require the {what} '{key}', {why}")
                continue
            kept.append((key, sub, need))
        return kept, extra

    def other_keys(self, schema: dict[str, Any], pattern: str) -> str:
        """A terminal for the keys *pattern* allows that are not the schema's properties."""
        names = " | ".join(literal(k) for k in schema.get("properties") or {})
        term = f"K{len(self.rules)}"
        self.rules.append(f"{term}: {lark_regex(pattern)}" + (f" & ~({names})" if names else ""))
        return term

    def only(self, schema: dict[str, Any], allowed: frozenset[str], what: str) -> None:
        """Refuse a keyword of *schema* that the grammar for *what* would ignore."""
        extra = sorted(set(schema) - allowed - ANNOTATIONS)
        if extra:
            raise self.refuse(f"use {', '.join(map(repr, extra))} on {what}")


def schema_types(schema: dict[str, Any]) -> list[str | None]:
    """The types a schema allows (None: not said)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        return list(kind)
    if isinstance(kind, str):
        return [kind]
    if "properties" in schema or "additionalProperties" in schema or "required" in schema:
        return ["object"]
    if "items" in schema or "prefixItems" in schema:
        return ["array"]
    if any(k in schema for k in ("minLength", "maxLength", "pattern", "format")):
        return ["string"]
    return [None]


def repeat(item: str, low: int, high: int | None) -> str:
    """``item`` *low* to *high* times (None: no bound), comma separated, possibly none."""
    if high is not None and high <= 0:
        return ""
    rest_low, rest_high = max(low - 1, 0), (None if high is None else high - 1)
    rest = f'("," {item}){{{rest_low},{"" if rest_high is None else rest_high}}}'
    if rest_high == 0:
        rest = ""
    body = f"{item} {rest}".strip()
    return f"({body})" if low >= 1 else f"({body})?"


def schema_type(schema: Any) -> str | None:
    """The schema's one non-null type (``["integer", "null"]`` -> ``integer``)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    return kind if isinstance(kind, str) else None


def chain(rules: SchemaRules, pairs: list[tuple[str, bool]], extra: str | None, comma: str) -> str:
    """Members in order, the required ones always and the optional ones at most
    once, then any number of *extra* ones; joined by *comma* (may be empty)."""
    sep = f"{comma} " if comma else ""
    rest = rules.rule(f"({sep}{extra})*" if extra else '""')  # after a member was written
    first = rules.rule(f"({extra} ({sep}{extra})*)?" if extra else '""')  # nothing written yet
    for pair, required in reversed(pairs):
        after = rest  # the members after this one, once one was written
        rest = rules.rule(f"{sep}{pair} {after}" if required else f"({sep}{pair})? {after}")
        first = rules.rule(f"{pair} {after}" if required else f"{pair} {after} | {first}")
    return first


# -- Gemma 4 ------------------------------------------------------------------------------

GEMMA4_QUOTE = '<|"|>'
GEMMA4_KEY = r"[A-Za-z_][A-Za-z0-9_.-]*"
_GEMMA4_ANY = (
    'gany: gstr | GNUM | "true" | "false" | "null" | gobj | glist',
    f"gstr: {literal(GEMMA4_QUOTE)} gtext",
    f"gtext[suffix={literal(GEMMA4_QUOTE)}]: GTEXT",
    f"GTEXT: /(?s:.*)/ & ~{lark_regex(f'(?s:.*){re.escape(GEMMA4_QUOTE)}(?s:.*)')}",
    r"GNUM: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/",
    'gobj: "{" (GKEY ":" gany ("," GKEY ":" gany)*)? "}"',
    'glist: "[" (gany ("," gany)*)? "]"',
    f"GKEY: {lark_regex(GEMMA4_KEY)}",
)


def gemma4_text(value: Any) -> str:
    """A value as Gemma 4's template writes it (strings in ``<|"|>``, bare keys)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return GEMMA4_QUOTE + value + GEMMA4_QUOTE
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{gemma4_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma4_text(v) for v in value) + "]"
    return json.dumps(value)


class Gemma4Rules(SchemaRules):
    """Values in Gemma 4's syntax: ``{key:value,...}``, ``[...]``, ``<|"|>text<|"|>``,
    and JSON numbers, booleans and null (llguidance's ``%json``)."""

    def __init__(self) -> None:
        super().__init__("gemma4", [GEMMA4_QUOTE])
        self.generic = False

    def anything(self) -> str:
        self.generic = True
        return "gany"

    def all_rules(self) -> list[str]:
        return [*self.rules, *(_GEMMA4_ANY if self.generic else ())]

    def value(self, schema: Any) -> str:
        if schema is True or (isinstance(schema, dict) and not set(schema) - ANNOTATIONS):
            return self.anything()
        if not isinstance(schema, dict):
            raise self.refuse("allow no value somewhere (false)")
        if set(schema) - ANNOTATIONS == {"$ref"}:
            ref = schema["$ref"]
            if ref not in self.named:
                self.named[ref], at = self.reserve()
                self.fill(at, self.value(self.resolve(ref)))
            return self.named[ref]
        schema = self.merged(schema)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                siblings = {k: v for k, v in schema.items() if k != key}
                branches = [b if b is True else {**siblings, **b} for b in schema[key]]
                return self.rule(" | ".join(self.value(b) for b in branches))
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else list(schema["enum"])
            if any(isinstance(v, str) and GEMMA4_QUOTE in v for v in values):
                raise self.refuse(f"have an enum value containing {GEMMA4_QUOTE}")
            return self.rule(" | ".join(literal(gemma4_text(v)) for v in values))
        types = schema_types(schema)
        if len(types) > 1:
            return self.rule(" | ".join(self.value({**schema, "type": t}) for t in types))
        kind = types[0]
        if kind is None:
            self.only(schema, frozenset(), "a value of no type")
            return self.anything()
        if kind == "string":
            text = self.raw_string(schema_without_type(schema), GEMMA4_QUOTE)
            return self.rule(f"{literal(GEMMA4_QUOTE)} {text}")
        if kind in ("number", "integer", "boolean", "null"):
            self.only(schema, SCALAR_KEYS, f"a {kind}")
            return self.embedded({k: v for k, v in schema.items() if k in SCALAR_KEYS})
        if kind == "object":
            return self.object(schema)
        if kind == "array":
            return self.array(schema)
        raise self.refuse(f"use the type {kind!r}")

    def object(self, schema: dict[str, Any]) -> str:
        self.only(schema, OBJECT_KEYS, "an object")
        members, extra = self.members(schema, GEMMA4_KEY, "key", "which is not a bare key")
        pairs = [
            (self.rule(f"{literal(key + ':')} {self.value(sub)}"), need)
            for key, sub, need in members
        ]
        more = None
        if extra is not False:
            name = self.other_keys(schema, GEMMA4_KEY)
            more = self.rule(f'{name} ":" {self.value(extra)}')
        return self.rule(f'"{{" {chain(self, pairs, more, literal(","))} "}}"')

    def array(self, schema: dict[str, Any]) -> str:
        self.only(schema, ARRAY_KEYS, "a list")
        prefix = list(schema.get("prefixItems") or [])
        items = schema.get("items", True)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if items is False:
            high = len(prefix) if high is None else min(high, len(prefix))
        if high is not None:
            prefix = prefix[:high]
        if low > len(prefix) and items is False:
            raise self.refuse("require more list items than prefixItems allows")
        count = len(prefix)
        more_high = None if high is None else high - count
        item = self.value(items) if items is not False and more_high != 0 else None
        if not prefix:
            body = repeat(item, low, high) if item else ""
        else:
            tail = ""
            if item:
                top = "" if more_high is None else more_high
                tail = f'("," {item}){{{max(low - count, 0)},{top}}}'
            elements = [self.value(p) for p in prefix]
            body = tail
            for at in range(count - 1, 0, -1):  # element at+1 follows element at
                step = f'"," {elements[at]} {body}'.strip()
                body = step if at < low else f"({step})?"
            first = f"{elements[0]} {body}".strip()
            body = first if low >= 1 else f"({first})?"
        return self.rule(f'"[" {body} "]"'.replace("  ", " "))


def schema_without_type(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != "type"}


def gemma4_call_rule(rules: Gemma4Rules, name: str, parameters: dict[str, Any]) -> str:
    """``NAME{...}`` for one tool, its arguments following *parameters*."""
    rules.start_tool(name, parameters)
    if schema_types(rules.merged(parameters)) not in (["object"], [None]):
        raise ValueError(
            f"tools: the parameters of '{name}' must be a JSON schema of type object, "
            f"got type {parameters.get('type')!r}"
        )
    return rules.rule(f"{literal(name)} {rules.object(rules.merged(parameters))}")


# -- Qwen3.5's XML ------------------------------------------------------------------------

# A raw value ends at the parser's first ``</parameter>``; ``</function>`` would end the call.
QWEN_XML_FORBIDDEN = ("</parameter>", "</function>")
QWEN_XML_NAME = r"[^>\n\s](?:[^>\n]{0,126}[^>\n\s])?"
_QWEN_END = "\n</parameter>\n"


class QwenXmlRules(SchemaRules):
    """Parameters in Qwen3.5's XML syntax: each ``<parameter=K>\\nV\\n</parameter>``,
    a string-typed V raw, any other V JSON (llguidance's ``%json``), read back as
    the parser reads them (by the parameter's type)."""

    def __init__(self) -> None:
        super().__init__("qwen3_xml", QWEN_XML_FORBIDDEN)

    def value(self, schema: Any) -> str:
        """A parameter's value and the end of its block."""
        if schema is True or (isinstance(schema, dict) and not set(schema) - ANNOTATIONS):
            return self.raw_string({}, _QWEN_END)  # untyped: read as JSON if it parses
        if schema_type(schema) == "string":
            merged = self.merged(schema)
            return self.raw_string(schema_without_type(merged), _QWEN_END)
        return self.rule(f"{self.embedded(schema)} {literal(_QWEN_END)}")

    def call(self, name: str, parameters: dict[str, Any]) -> str:
        """``NAME>\\n`` and the parameter blocks of one call."""
        self.start_tool(name, parameters)
        schema = self.merged(parameters)
        if schema_types(schema) not in (["object"], [None]):
            raise ValueError(
                f"tools: the parameters of '{name}' must be a JSON schema of type object, "
                f"got type {parameters.get('type')!r}"
            )
        self.only(schema, OBJECT_KEYS, "the parameters")
        members, extra = self.members(schema, QWEN_XML_NAME, "parameter", "which has no XML name")
        pairs = [
            (self.rule(f"{literal(f'<parameter={key}>{chr(10)}')} {self.value(sub)}"), need)
            for key, sub, need in members
        ]
        more = None
        if extra is not False:
            term = self.other_keys(schema, QWEN_XML_NAME)
            more = self.rule(f'"<parameter=" {term} ">\\n" {self.value(extra)}')
        return self.rule(f"{literal(name + '>' + chr(10))} {chain(self, pairs, more, '')}")
