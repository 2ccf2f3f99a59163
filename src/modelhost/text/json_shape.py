"""A JSON schema as the shapes a closing tracker needs, each with its shortest valid text.

`shape_of(schema)` reads the subset of JSON Schema whose shortest valid value it can name for
certain: types (and type lists), properties with `required` (in declared order, as the grammar
engine enforces them), `additionalProperties`, `enum`/`const`, `items`/`prefixItems` with
`minItems`, `minLength`, integer bounds, `anyOf`/`oneOf`, `nullable`, single-schema `allOf` and
local `$ref`s (recursion included). Anything else that constrains a value (`pattern`, `format`,
`not`, `if`, ...) raises `ShapeUnsupported`: the caller then enforces the grammar without a
closing guarantee rather than promise one it cannot keep.

Texts are written the way the grammar (xgrammar, compact: `", "` and `": "` between members,
enum values with no spaces) accepts them; `shortest` is in bytes of UTF-8.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

_UNSUPPORTED = (
    "pattern",
    "format",
    "not",
    "if",
    "then",
    "else",
    "patternProperties",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "multipleOf",
)


class ShapeUnsupported(ValueError):
    """The schema uses a keyword whose shortest valid value this module cannot name."""


class Shape:
    """One schema node. `alternatives()` are the concrete shapes a value may take (a union
    expands to its options); `shortest()` is the shortest valid text, None when none is finite."""

    __slots__ = ("_shortest", "_busy")

    def __init__(self) -> None:
        self._shortest: bytes | None = None
        self._busy = False

    def alternatives(self) -> tuple[Shape, ...]:
        return (self,)

    def shortest(self) -> bytes | None:
        if self._shortest is None:
            if self._busy:  # a recursion back into itself: no finite value down this path
                return None
            self._busy = True
            try:
                self._shortest = self._compute_shortest()
            finally:
                self._busy = False
        return self._shortest

    def _compute_shortest(self) -> bytes | None:
        raise NotImplementedError


class AnyValue(Shape):
    """Any JSON value (an untyped schema, the members of a free-form object)."""

    __slots__ = ()

    def _compute_shortest(self) -> bytes | None:
        return b"0"


class Literal(Shape):
    """One of a fixed set of texts (`enum`, `const`, `true`/`false`/`null`, a choice)."""

    __slots__ = ("texts",)

    def __init__(self, texts: tuple[bytes, ...]) -> None:
        super().__init__()
        if not texts:
            raise ShapeUnsupported("an empty enum has no valid value")
        self.texts = texts

    def _compute_shortest(self) -> bytes | None:
        return min(self.texts, key=len)


class Text(Shape):
    """A JSON string of at least `min_length` characters."""

    __slots__ = ("min_length",)

    def __init__(self, min_length: int = 0) -> None:
        super().__init__()
        self.min_length = min_length

    def _compute_shortest(self) -> bytes | None:
        return b'"' + b"a" * self.min_length + b'"'


class Number(Shape):
    """A JSON number (`integer` when `integral`) within inclusive bounds (None: unbounded)."""

    __slots__ = ("integral", "low", "high")

    def __init__(self, integral: bool, low: float | None, high: float | None) -> None:
        super().__init__()
        self.integral = integral
        self.low = low
        self.high = high

    def _compute_shortest(self) -> bytes | None:
        low = -math.inf if self.low is None else math.ceil(self.low)
        high = math.inf if self.high is None else math.floor(self.high)
        if low > high:
            if self.integral:
                raise ShapeUnsupported("an integer range with no integer in it")
            raise ShapeUnsupported("a number range with no integer in it")
        value = 0 if low <= 0 <= high else (low if low > 0 else high)
        return str(int(value)).encode()


class Items(Shape):
    """A JSON array: `prefix` item shapes first, then `rest` (None: no more items)."""

    __slots__ = ("prefix", "rest", "min_items")

    def __init__(self, prefix: tuple[Shape, ...], rest: Shape | None, min_items: int) -> None:
        super().__init__()
        self.prefix = prefix
        self.rest = rest
        self.min_items = min_items

    def item(self, index: int) -> Shape | None:
        return self.prefix[index] if index < len(self.prefix) else self.rest

    def _compute_shortest(self) -> bytes | None:
        texts = []
        for index in range(self.min_items):
            item = self.item(index)
            text = item.shortest() if item is not None else None
            if text is None:
                return None
            texts.append(text)
        return b"[" + b", ".join(texts) + b"]"


class Members(Shape):
    """A JSON object: declared `properties` in order (key, shape, required), then any other
    key whose value is `extra` (None: no other keys)."""

    __slots__ = ("properties", "extra", "_keys")

    def __init__(
        self, properties: tuple[tuple[bytes, Shape, bool], ...], extra: Shape | None
    ) -> None:
        super().__init__()
        self.properties = properties
        self.extra = extra
        self._keys = {key: index for index, (key, _, _) in enumerate(properties)}

    def index_of(self, key: bytes) -> int | None:
        return self._keys.get(key)

    def next_keys(self, start: int) -> range:
        """Indices of the declared properties that may come next, after `start` members:
        up to and including the first required one (required ones are never skipped)."""
        end = start
        while end < len(self.properties):
            end += 1
            if self.properties[end - 1][2]:
                break
        return range(start, end)

    def required_after(self, start: int) -> bytes | None:
        """The shortest text of the required members from index `start` on, each led by
        `", "`; None when one of them has no finite value."""
        parts = []
        for key, shape, required in self.properties[start:]:
            if required:
                text = shape.shortest()
                if text is None:
                    return None
                parts.append(b", " + _member(key, text))
        return b"".join(parts)

    def _compute_shortest(self) -> bytes | None:
        tail = self.required_after(0)
        if tail is None:
            return None
        return b"{" + tail[2:] + b"}"


class Union(Shape):
    """`anyOf`/`oneOf`/a list of types: a value of any option."""

    __slots__ = ("options",)

    def __init__(self, options: tuple[Shape, ...]) -> None:
        super().__init__()
        self.options = options

    def alternatives(self) -> tuple[Shape, ...]:
        return tuple(alt for option in self.options for alt in option.alternatives())

    def _compute_shortest(self) -> bytes | None:
        texts = [text for option in self.options if (text := option.shortest()) is not None]
        return min(texts, key=len) if texts else None


class Reference(Shape):
    """A `$ref`, resolved on first use so that recursive schemas are finite graphs."""

    __slots__ = ("_builder", "_pointer", "_target")

    def __init__(self, builder: _Builder, pointer: str) -> None:
        super().__init__()
        self._builder = builder
        self._pointer = pointer
        self._target: Shape | None = None

    def target(self) -> Shape:
        if self._target is None:
            self._target = self._builder.resolve(self._pointer)
        return self._target

    def alternatives(self) -> tuple[Shape, ...]:
        return self.target().alternatives()

    def _compute_shortest(self) -> bytes | None:
        return self.target().shortest()


def growth(shape: Shape) -> int:
    """The most one byte of JSON can lengthen the shortest completion of a value of `shape`.

    A byte opens at most one value (a container, an array item, a member with its key), or
    commits an open key or literal to a longer one; each is bounded by the longest text among
    the reachable shapes' shortest values, keys and literals. Walks the whole shape graph: call
    it once per shape."""
    longest = 0
    seen: set[int] = set()
    todo = [shape]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        text = node.shortest()
        longest = max(longest, len(text) if text is not None else 0)
        if isinstance(node, Literal):
            longest = max(longest, *(len(text) for text in node.texts))
        if isinstance(node, Members):
            longest = max(longest, 0, *(len(key) for key, _, _ in node.properties))
        todo.extend(_children(node))
    # A member writes `, ` + key + `: ` + value; a bounded number's digits stay under 32.
    return 2 * longest + 32


def _children(node: Shape) -> list[Shape]:
    if isinstance(node, Reference):
        return [node.target()]
    if isinstance(node, Union):
        return list(node.options)
    if isinstance(node, Members):
        kids = [shape for _, shape, _ in node.properties]
        return kids + ([node.extra] if node.extra is not None else [])
    if isinstance(node, Items):
        return list(node.prefix) + ([node.rest] if node.rest is not None else [])
    return []


def _member(key: bytes, value: bytes) -> bytes:
    return key + b": " + value


def json_text(value: Any) -> bytes:
    """A JSON value written as the grammar writes enum and const values: no spaces."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def shape_of(schema: Any) -> Shape:
    """The shape of a JSON schema (a dict, or its JSON text); ShapeUnsupported when it uses
    something this module cannot close, or has no finite valid value."""
    if isinstance(schema, str | bytes):
        schema = json.loads(schema)
    shape = _Builder(schema).build(schema)
    if shape.shortest() is None:
        raise ShapeUnsupported("the schema has no finite valid value")
    return shape


def choice_shape(choices: tuple[str, ...]) -> Shape:
    """One of `choices`, as raw text (guided_choice)."""
    return Literal(tuple(choice.encode() for choice in choices))


class _Builder:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.by_pointer: dict[str, Shape] = {}

    def resolve(self, pointer: str) -> Shape:
        if pointer not in self.by_pointer:
            self.by_pointer[pointer] = self.build(_lookup(self.root, pointer))
        return self.by_pointer[pointer]

    def build(self, schema: Any) -> Shape:
        if schema is True or (isinstance(schema, Mapping) and not schema):
            return AnyValue()
        if not isinstance(schema, Mapping):
            raise ShapeUnsupported("a schema that is not an object")
        for keyword in _UNSUPPORTED:
            if keyword in schema:
                raise ShapeUnsupported(f"the {keyword!r} keyword")
        shape = self._build(schema)
        if schema.get("nullable") is True:
            shape = Union((shape, Literal((b"null",))))
        return shape

    def _build(self, schema: Mapping[str, Any]) -> Shape:
        if "$ref" in schema:
            if len(set(schema) - {"$ref", "description", "title", "$defs", "definitions"}):
                raise ShapeUnsupported("$ref beside other keywords")
            return Reference(self, schema["$ref"])
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise ShapeUnsupported("allOf with more than one schema")
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            return self.build({**rest, **parts[0]} if rest else parts[0])
        if "const" in schema:
            return Literal((json_text(schema["const"]),))
        if "enum" in schema:
            return Literal(tuple(json_text(value) for value in schema["enum"]))
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                base = {k: v for k, v in schema.items() if k != keyword}
                options = [self.build({**base, **option}) for option in schema[keyword]]
                return Union(tuple(options))
        kind = schema.get("type")
        if isinstance(kind, list):
            return Union(tuple(self._typed(schema, str(k)) for k in kind))
        if kind is None:
            if "properties" in schema or "required" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                return AnyValue()
        return self._typed(schema, str(kind))

    def _typed(self, schema: Mapping[str, Any], kind: str) -> Shape:
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return Text(int(schema.get("minLength", 0)))
        if kind in ("integer", "number"):
            return self._number(schema, integral=kind == "integer")
        if kind == "boolean":
            return Literal((b"true", b"false"))
        if kind == "null":
            return Literal((b"null",))
        raise ShapeUnsupported(f"type {kind!r}")

    def _object(self, schema: Mapping[str, Any]) -> Shape:
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        if not required <= set(properties):
            raise ShapeUnsupported("a required key without a declared schema")
        if int(schema.get("minProperties", 0)) > len(required):
            raise ShapeUnsupported("minProperties beyond the required keys")
        members = tuple(
            (json_text(key), self.build(sub), key in required) for key, sub in properties.items()
        )
        additional = schema.get("additionalProperties", not properties)
        extra: Shape | None
        if additional is False:
            extra = None
        elif additional is True:
            extra = AnyValue()
        else:
            extra = self.build(additional)
        return Members(members, extra)

    def _array(self, schema: Mapping[str, Any]) -> Shape:
        prefix = tuple(self.build(sub) for sub in schema.get("prefixItems") or ())
        items = schema.get("items", True)
        rest = None if items is False else self.build(items)
        min_items = int(schema.get("minItems", 0))
        if schema.get("uniqueItems") and min_items > 1:
            raise ShapeUnsupported("uniqueItems with minItems above 1")
        return Items(prefix, rest, min_items)

    def _number(self, schema: Mapping[str, Any], *, integral: bool) -> Shape:
        low = schema.get("minimum")
        high = schema.get("maximum")
        above = schema.get("exclusiveMinimum")
        below = schema.get("exclusiveMaximum")
        if isinstance(above, bool) or isinstance(below, bool):  # draft 4's boolean form
            raise ShapeUnsupported("boolean exclusiveMinimum/exclusiveMaximum")
        if not integral and (above is not None or below is not None):
            raise ShapeUnsupported("exclusive bounds on a number")
        if above is not None:
            low = max(low, math.floor(above) + 1) if low is not None else math.floor(above) + 1
        if below is not None:
            high = min(high, math.ceil(below) - 1) if high is not None else math.ceil(below) - 1
        return Number(integral, low, high)


def _lookup(root: Any, pointer: str) -> Any:
    if not pointer.startswith("#"):
        raise ShapeUnsupported(f"a non-local $ref {pointer!r}")
    node = root
    for part in pointer[1:].split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ShapeUnsupported(f"an unresolvable $ref {pointer!r}")
    return node
