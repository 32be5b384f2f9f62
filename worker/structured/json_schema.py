"""What of a JSON schema xgrammar enforces, and the rewrite it is compiled through.

``unenforced_keyword`` finds the first assertion the grammar would silently drop, so that a schema
is refused with its keyword and path named instead of answered with output that does not validate
(as vLLM refuses what xgrammar cannot do). Each rule was found by compiling a schema with the
installed xgrammar and walking a matcher over a string that violates the keyword; the findings
are tabled in docs/structured_outputs.md. Annotations (title, description, default, examples,
unknown keywords, formats JSON Schema does not define) assert nothing and are kept.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# JSON may be laid out freely, but a run of whitespace in it is at most this many characters:
# enough to indent 7 levels of 4 spaces, and a model cannot loop on newlines until max_tokens.
JSON_MAX_WHITESPACE = 32

# Keywords whose values are JSON data, not subschemas.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Assertions xgrammar ignores wherever they stand.
_NEVER_ENFORCED = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
                   "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef")
# Beside one of these, xgrammar applies none of the schema's other assertions.
_EXCLUSIVE = ("$ref", "allOf", "anyOf", "oneOf", "const", "enum")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_OTHER_ASSERTIONS = ("type", "properties", "required", "additionalProperties", "patternProperties",
                     "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties", "items",
                     "prefixItems", "minItems", "maxItems", "unevaluatedItems", "uniqueItems")
_ASSERTIONS = frozenset(_EXCLUSIVE + _NUMBER_KEYWORDS + _STRING_KEYWORDS + _OTHER_ASSERTIONS)
# Formats JSON Schema defines that xgrammar lets any string through for.
_UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "array": (list,), "object": (dict,)}
_NAME = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]*")


class Unenforced(NamedTuple):
    keyword: str
    path: str  # JSONPath of the schema holding it, "$" for the root
    why: str


def unenforced_keyword(schema) -> Unenforced | None:
    """The first assertion in ``schema`` (parsed JSON) that xgrammar would not enforce."""
    stack = [(schema, "$")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema is enforced; anything else xgrammar refuses itself
        found = _unenforced_here(node, path)
        if found is not None:
            return found
        children = [(node[k], f"{path}.{k}") for k in _SUBSCHEMAS if k in node]
        names = node.get("propertyNames")
        if isinstance(names, dict) and "type" not in names:  # it constrains keys: strings, as xgrammar takes it
            children[[k for k in _SUBSCHEMAS if k in node].index("propertyNames")] = (
                {"type": "string", **names}, f"{path}.propertyNames")
        for k in _SUBSCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                children += [(v, f"{path}.{k}{_member(name)}") for name, v in node[k].items()]
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                children += [(v, f"{path}.{k}[{i}]") for i, v in enumerate(node[k])]
        stack.extend(reversed(children))
    return None


def _unenforced_here(node: dict, path: str) -> Unenforced | None:
    for keyword in _NEVER_ENFORCED:
        if keyword in node:
            return Unenforced(keyword, path, "xgrammar does not enforce it")
    if node.get("uniqueItems") is True:
        return Unenforced("uniqueItems", path, "xgrammar does not enforce it")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) != 1:
        return Unenforced("allOf", path, "xgrammar enforces an allOf of exactly one schema only")
    exclusive = [k for k in _EXCLUSIVE if k in node]
    if exclusive:
        return _beside(node, path, exclusive)
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    for keyword in _NUMBER_KEYWORDS:
        if keyword in node and not types & {"integer", "number"}:
            return Unenforced(keyword, path, 'xgrammar enforces it only beside "type" integer or number')
    for keyword in _STRING_KEYWORDS:
        if keyword in node and "string" not in types:
            return Unenforced(keyword, path, 'xgrammar enforces it only beside "type" string')
    step = node.get("multipleOf")
    if step is not None and (types != {"integer"} or isinstance(step, bool) or not isinstance(step, int)):
        return Unenforced("multipleOf", path, 'xgrammar enforces only a whole multipleOf of "type" integer')
    if node.get("format") in _UNENFORCED_FORMATS:
        return Unenforced("format", path, f"xgrammar does not enforce the format {node['format']!r}")
    return None


def _beside(node: dict, path: str, exclusive: list[str]) -> Unenforced | None:
    """A schema with $ref, a combinator, const or enum: xgrammar applies that one alone."""
    first = exclusive[0]
    values = [node["const"]] if first == "const" else node.get("enum") if first == "enum" else None
    for keyword in node:
        if keyword == first or keyword not in _ASSERTIONS:
            continue
        if keyword == "type" and isinstance(values, list) and all(_is_of_type(v, node["type"]) for v in values):
            continue  # the values themselves say it
        return Unenforced(keyword, path, f"xgrammar ignores it beside {first!r}")
    if first == "oneOf" and isinstance(node["oneOf"], list):
        return _overlapping_members(node, path)
    return None


def _overlapping_members(node: dict, path: str) -> Unenforced | None:
    """xgrammar compiles oneOf as anyOf: right only where no value matches two members."""
    members = [_resolved(m, node) for m in node["oneOf"]]
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            if not _disjoint(a, b):
                return Unenforced("oneOf", path, "xgrammar enforces oneOf as anyOf, and two of its schemas "
                                  "may match one value (give them distinct types, consts or a const tag)")
    return None


def _resolved(member, root: dict):
    # A local $ref one level deep: the usual shape of a tagged union's members.
    ref = member.get("$ref") if isinstance(member, dict) else None
    if isinstance(ref, str):
        for prefix in ("#/$defs/", "#/definitions/"):
            defs = root.get(prefix[2:-1])
            if ref.startswith(prefix) and isinstance(defs, dict):
                return defs.get(ref[len(prefix):], member)
    return member


def _disjoint(a, b) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None:
        widen = {"integer": {"integer", "number"}, "number": {"integer", "number"}}
        if not any(t in widen.get(u, {u}) for t in ta for u in tb):
            return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not any(x == y and type(x) is type(y) for x in va for y in vb):
        return True
    # Objects told apart by a required property whose consts differ (a tagged union).
    pa, pb = a.get("properties"), b.get("properties")
    if isinstance(pa, dict) and isinstance(pb, dict):
        for tag in set(a.get("required") or []) & set(b.get("required") or []):
            if isinstance(pa.get(tag), dict) and isinstance(pb.get(tag), dict) and _disjoint(pa[tag], pb[tag]):
                return True
    return False


def _types(schema: dict) -> set[str] | None:
    t = schema.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None


def _values(schema: dict) -> list | None:
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def _is_of_type(value, types) -> bool:
    names = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if isinstance(value, bool):
        return "boolean" in names
    if isinstance(value, float) and value.is_integer() and "integer" in names:
        return True
    return any(isinstance(value, _JSON_TYPES.get(n, ())) for n in names)


def _member(name: str) -> str:
    return f".{name}" if _NAME.fullmatch(name) else f"[{name!r}]"


def length_bounds_as_patterns(schema):
    """``schema`` with each plain string's minLength/maxLength spelled as a pattern of as many
    characters. xgrammar lowers a length-bounded string to a character class that lets raw control
    characters through (invalid JSON; mlc-ai/xgrammar#800), while its pattern path keeps to JSON's
    string syntax. Either way a bounded string holds no escape sequences."""
    if isinstance(schema, list):
        return [length_bounds_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else length_bounds_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^[\\s\\S]{{{low},{high}}}$"
    return out
