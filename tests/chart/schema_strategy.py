"""Hypothesis strategies for the JSON Schema subset ``values.schema.json`` uses (draft-07: type, enum,
const, properties/required, additionalProperties, items, min/maxItems, minimum/maximum/exclusiveMinimum,
pattern, min/maxLength, $ref to ``#/definitions``, allOf, oneOf, propertyNames).

hypothesis-jsonschema would do this, but its release does not run on the pinned Hypothesis (it uses
internals Hypothesis has since changed). Every value drawn is checked against its (sub)schema with
``jsonschema`` before it is used, so a gap here narrows what is generated; it never lets an invalid
value through."""

from __future__ import annotations

from typing import Any

import jsonschema
from hypothesis import strategies as st

#: Longest free string drawn (labels, names): long enough to hit length limits of short fields.
MAX_TEXT = 12
#: Longest free map or list drawn where the schema sets no bound.
MAX_ENTRIES = 3
_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=MAX_TEXT)
_KEY = st.from_regex(r"[a-z][a-z0-9.-]{0,10}", fullmatch=True)


def strategy(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under ``schema`` (``root`` holds the ``definitions`` its ``$ref`` point to)."""
    validator = jsonschema.Draft7Validator({**schema, "definitions": root.get("definitions", {})})
    return _unchecked(schema, root).filter(validator.is_valid)


def resolved(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$ref`` (to ``#/definitions/...``) and ``allOf`` parts merged in."""
    if "$ref" in schema:
        target = root["definitions"][schema["$ref"].removeprefix("#/definitions/")]
        schema = {**resolved(target, root), **{k: v for k, v in schema.items() if k != "$ref"}}
    for part in schema.get("allOf", ()):
        part = resolved(part, root)
        props = {**part.get("properties", {}), **schema.get("properties", {})}
        required = [*part.get("required", ()), *schema.get("required", ())]
        schema = {**part, **schema, "properties": props, "required": required}
    return {k: v for k, v in schema.items() if k != "allOf"}


def _unchecked(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    schema = resolved(schema, root)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        rest = {k: v for k, v in schema.items() if k != "oneOf"}
        return st.one_of([_unchecked({**rest, **resolved(branch, root)}, root) for branch in schema["oneOf"]])
    types = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(types, list):
        return st.one_of([_unchecked({**schema, "type": t}, root) for t in types])
    if types == "null":
        return st.none()
    if types == "boolean":
        return st.booleans()
    if types in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", -(10**6)))
        high = schema.get("maximum", 10**6)
        if types == "integer":
            # Mostly small (replica counts that can agree with each other), sometimes anything allowed.
            return st.one_of(st.integers(int(low), int(min(high, low + 4))), st.integers(int(low), int(high)))
        return st.floats(low, high, allow_nan=False, allow_infinity=False)
    if types == "string":
        if "pattern" in schema:
            # Not ending in a newline: Python's `$` matches before one, Go's (helm's and the API server's) does
            # not, so such a string passes jsonschema here and fails every validator that matters.
            return st.from_regex(schema["pattern"], fullmatch=False).filter(
                lambda s: len(s) <= schema.get("maxLength", 10**6) and not s.endswith("\n")
            )
        return st.text(
            st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
            min_size=schema.get("minLength", 0),
            max_size=min(schema.get("maxLength", MAX_TEXT), MAX_TEXT),
        )
    if types == "array":
        items = _unchecked(schema.get("items", {"type": "string"}), root)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", MAX_ENTRIES), MAX_ENTRIES)))
    return _object(schema, root)


def _object(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed = st.fixed_dictionaries(
        {k: _unchecked(v, root) for k, v in props.items() if k in required},
        optional={k: _unchecked(v, root) for k, v in props.items() if k not in required},
    )
    extra = schema.get("additionalProperties", True)
    if extra is False or props:
        return fixed
    values = _TEXT if extra is True else _unchecked(extra, root)
    return st.dictionaries(_KEY, values, max_size=MAX_ENTRIES)
