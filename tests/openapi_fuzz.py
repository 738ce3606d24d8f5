"""Hypothesis strategies for HTTP requests built from an OpenAPI schema (FastAPI's `app.openapi()`).

Two in five requests fit their operation's schema (types, bounds, enums, required fields, nested models) and carry the
`hints`: the values, by property or header name, that a random one would almost never hit (the served model's name,
the API key); so they get past validation to the code behind it. The others are broken on purpose: somewhere inside
the body a value of any JSON type, a field left out or an unknown one added; a top-level field holding another value
its schema allows (the hint's place taken by a random one); a body of another JSON type; bytes that are no JSON at
all; a header of any value, or none.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from hypothesis import strategies as st

MAX_ITEMS = 4  # arrays without a maxItems
MAX_TEXT = 40

junk = st.recursive(  # any JSON value; NaN and infinities too, which Python's json (and so FastAPI) reads
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=MAX_TEXT),
    lambda inner: st.lists(inner, max_size=MAX_ITEMS) | st.dictionaries(st.text(max_size=8), inner,
                                                                        max_size=MAX_ITEMS),
    max_leaves=8)
# what an HTTP header carries: printable ASCII, no whitespace at either end
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=MAX_TEXT).map(str.strip)


@dataclass
class Operation:
    method: str
    path: str
    headers: dict  # header name -> its schema (every one documented is an optional string: any text is fuzzed)
    body: dict | None  # the request body's schema


def operations(openapi: dict) -> list[Operation]:
    """Every (method, path) the schema documents."""
    out = []
    for path, methods in openapi["paths"].items():
        for method, op in methods.items():
            headers = {p["name"]: p["schema"] for p in op.get("parameters", []) if p["in"] == "header"}
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            out.append(Operation(method.upper(), path, headers, body))
    return out


def fitting(schema: dict, openapi: dict, hints: dict, name: str | None = None) -> st.SearchStrategy:
    """Values that satisfy `schema`; a property named in `hints` takes the hinted values instead."""
    return hints[name] if name in hints else _fitting(schema, openapi, hints)


def _fitting(schema: dict, openapi: dict, hints: dict) -> st.SearchStrategy:
    if "$ref" in schema:
        return fitting(_resolve(schema["$ref"], openapi), openapi, hints)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([fitting(sub, openapi, hints) for sub in schema[key]])
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return fitting(schema["allOf"][0], openapi, hints)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", MAX_TEXT))
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            low = math.floor(schema["exclusiveMinimum"]) + 1
        if "exclusiveMaximum" in schema:
            high = math.ceil(schema["exclusiveMaximum"]) - 1
        return st.integers(None if low is None else math.ceil(low), None if high is None else math.floor(high))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                         schema.get("maximum", schema.get("exclusiveMaximum")),
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                         allow_nan=False)
    if kind == "array":
        return st.lists(fitting(schema.get("items", {}), openapi, hints), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", MAX_ITEMS))
    if kind == "object" or "properties" in schema:
        props, required = schema.get("properties", {}), set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: fitting(v, openapi, hints, k) for k, v in props.items() if k in required},
            optional={k: fitting(v, openapi, hints, k) for k, v in props.items() if k not in required})
    return junk  # no constraint at all


@st.composite
def broken(draw, schema: dict, openapi: dict, hints: dict):
    """A value of `schema` with one thing wrong: somewhere inside it (the body, a message, a content part, ...) a
    value replaced by any JSON value, a field left out or an unknown one added; or a top-level field holding another
    value its schema allows (no hint); or another JSON value altogether."""
    value = draw(fitting(schema, openapi, hints))
    how = draw(st.sampled_from(["inside"] * 3 + ["another value", "not an object"]))  # mostly deep inside
    if how == "not an object" or not isinstance(value, dict) or not value:
        return draw(junk)
    if how == "another value":
        field = draw(st.sampled_from(sorted(value)))
        return {**value, field: draw(_fitting(_resolve_all(schema, openapi)["properties"][field], openapi, {}))}
    return _spoil(draw, value)


def _spoil(draw, value):
    """`value` with one thing wrong, at a depth chosen as it descends (3 times in 4 into a container)."""
    deeper = draw(st.sampled_from([True] * 3 + [False]))
    if isinstance(value, dict) and value and deeper:
        key = draw(st.sampled_from(sorted(value)))
        return {**value, key: _spoil(draw, value[key])}
    if isinstance(value, list) and value and deeper:
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], _spoil(draw, value[i]), *value[i + 1:]]
    if not isinstance(value, dict) or not value:
        return draw(junk)
    how = draw(st.sampled_from(["any value"] * 2 + ["missing", "unknown"]))
    key = draw(st.sampled_from(sorted(value)))
    if how == "any value":
        return {**value, key: draw(junk)}
    if how == "missing":
        return {k: v for k, v in value.items() if k != key}
    return {**value, **draw(st.dictionaries(st.text(max_size=12), junk, min_size=1, max_size=MAX_ITEMS))}


@st.composite
def requests(draw, op: Operation, openapi: dict, hints: dict) -> dict:
    """httpx.request keyword arguments (method, url, headers, content) for `op`: 2 in 5 fit, 2 are broken, and 1
    (with a body) is no JSON."""
    kind = draw(st.sampled_from(["fits"] * 2 + ["broken"] * 2 + ["not json"]))
    fits = kind == "fits"
    headers = {}
    for name in op.headers:
        if fits and name in hints:
            headers[name] = draw(hints[name])
        elif (value := draw(st.none() | header_text | hints.get(name, st.nothing()))) is not None:
            headers[name] = value
    request = {"method": op.method, "url": op.path, "headers": headers}
    if op.body is None:
        return request
    if fits:
        body = draw(fitting(op.body, openapi, hints))
    elif kind == "broken":
        body = draw(broken(op.body, openapi, hints))
    else:
        body = draw(st.binary(max_size=MAX_TEXT))
    request["content"] = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN too, as Python writes
    headers["content-type"] = "application/json"
    return request


def _resolve_all(schema: dict, openapi: dict) -> dict:
    while "$ref" in schema:
        schema = _resolve(schema["$ref"], openapi)
    return schema


def _resolve(ref: str, openapi: dict) -> dict:
    node = openapi
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node
