"""A result declared once: a dataclass whose fields carry their schema (`schema_field`), with computed payload fields
as properties (`payload`), becomes a published kind (`published`): its `to_dict()`, JSON Schema, `to_frame()` columns
and docs/schemas.md section are made from those declarations. A field's JSON type comes from its annotation (`type=`
overrides it); the payload's keys follow the declarations' order; an attribute without `schema_field` is not in the
payload. A nested object is a `Payload` too; `spread=True` merges one's fields in at its place."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar, overload

from probe.schemas.base import Field, Kind

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
elif TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:  # Python 3.10 runs without it: it tells the type checker that a Payload is a dataclass

    def dataclass_transform(**_: Any) -> Callable[[T], T]:
        return lambda cls: cls

SPEC = "probe.schema"  # the key of a field's dataclasses metadata that holds its declaration
_order = itertools.count()  # declarations in the order they were written: the payload's key order
T = TypeVar("T")
R = TypeVar("R")
FieldType = str | tuple[str, ...]


@dataclass(frozen=True)
class Spec:
    """What one payload field declares besides its annotation (see `schema_field`)."""

    description: str
    required: bool = True
    key: str | None = None
    type: FieldType | None = None
    items: Field | str | None = None
    fields: dict[str, Field] | None = None
    patterns: dict[str, Field] | None = None
    omit: Literal["empty", "none"] = "empty"
    dump: Callable[[Any], Any] | None = None
    column: bool | str | Field = False
    spread: bool = False
    order: int = dataclasses.field(default_factory=lambda: next(_order))


@dataclass(frozen=True)
class Declared:
    """One payload field as declared: its key, the attribute holding it, its schema and column."""

    key: str
    attribute: str
    spec: Spec
    field: Field
    column: Field | None


SHARED = ("required", "type", "items", "fields", "patterns")  # what a shared Field declares of itself


def _spec(description: str | Field, options: dict[str, Any]) -> Spec:
    """A declaration (options: Spec's fields): its own meaning, or a shared Field (probe.schemas.common) as it is."""
    if isinstance(description, Field):
        return Spec(description.description, **{**options, **{name: getattr(description, name) for name in SHARED}})
    return Spec(description, **options)


def schema_field(description: str | Field, *, default: Any = dataclasses.MISSING,
                 default_factory: Any = dataclasses.MISSING, kw_only: Any = dataclasses.MISSING, **options: Any) -> Any:
    """A dataclass field that is also a payload field: its meaning, or a shared Field; `options`: Spec's fields.
    `required=False`: left out where None or empty (`omit="none"`: None only); `column`: also a frame column."""
    spec = _spec(description, options)
    return dataclasses.field(default=default, default_factory=default_factory, kw_only=kw_only,
                             metadata={SPEC: spec})


class Computed(property, Generic[R]):
    """A payload field computed from the result's other fields: a property whose `spec` the schema is made from."""

    spec: Spec

    def __init__(self, method: Callable[[Any], R], spec: Spec) -> None:
        super().__init__(method, doc=method.__doc__)
        self.spec = spec

    if TYPE_CHECKING:  # the value's type for the type checker: the method's return type
        @overload
        def __get__(self, instance: None, owner: type | None = None, /) -> Computed[R]: ...

        @overload
        def __get__(self, instance: object, owner: type | None = None, /) -> R: ...

        def __get__(self, instance: object, owner: type | None = None, /) -> Any: ...


def payload(description: str | Field, **options: Any) -> Callable[[Callable[[Any], R]], Computed[R]]:
    """A method whose value is a payload field, made a property typed by its return; options as `schema_field`'s."""
    spec = _spec(description, options)

    def mark(method: Callable[[Any], R]) -> Computed[R]:
        return Computed(method, spec)

    return mark


PRIMITIVES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _json_type(annotation: Any) -> tuple[list[str], Any]:
    """The JSON type(s) of an annotation, and what an array holds (its item annotation) or a record's class."""
    if annotation in (Any, object):
        return [], None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        found: list[str] = []
        inner = None
        for arg in args:
            kinds, item = (["null"], None) if arg is type(None) else _json_type(arg)
            found += [kind for kind in kinds if kind not in found]
            inner = inner if item is None else item
        return ([] if not found or found == ["null"] else found), inner
    if annotation in PRIMITIVES:
        return [PRIMITIVES[annotation]], None
    if _is_record(annotation):
        return ["object"], annotation
    base = origin or annotation
    if isinstance(base, type) and issubclass(base, Mapping):
        return ["object"], None
    if isinstance(base, type) and issubclass(base, Sequence) and base is not str:
        return ["array"], args[0] if args else None
    return [], None


def _field(name: str, annotation: Any, spec: Spec, where: str) -> Field:
    kinds, inner = _json_type(annotation)
    if not spec.required and "null" in kinds:  # an optional field is left out, never null
        kinds.remove("null")
    kind: FieldType | None = spec.type or (kinds[0] if len(kinds) == 1 else tuple(kinds) if kinds else None)
    if kind is None:
        raise TypeError(f"{where}.{name}: its annotation {annotation!r} gives no JSON type: pass type=")
    items = spec.items
    if isinstance(items, str):
        items = record_field(inner, items) if _is_record(inner) else Field(_json_type(inner)[0][0], items)
    elif items is None and _is_record(inner) and "array" in kinds and spec.type is None:
        raise TypeError(f"{where}.{name}: an array of records needs items= (their description), or type= to leave "
                        "its items undeclared")
    fields, patterns = spec.fields, spec.patterns
    if fields is None and spec.type is None and _is_record(inner) and "object" in kinds:  # a nested Payload
        fields, patterns = record_fields(inner), patterns or record_patterns(inner) or None
    return Field(kind, spec.description, spec.required, items, fields, patterns)


def _is_record(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Payload) and annotation is not Payload


def _column(key: str, spec: Spec, field: Field) -> Field | None:
    if spec.column is False:
        return None
    if isinstance(spec.column, Field):
        return spec.column
    description = spec.column if isinstance(spec.column, str) else field.description
    return Field(field.type, description, field.required)


def _declarations(cls: type) -> list[Declared]:
    """Every payload field of `cls` (fields with a spec, and `payload` properties), in declaration order."""
    hints = typing.get_type_hints(cls)
    specs: list[tuple[str, Any, Spec]] = [(item.name, hints[item.name], item.metadata[SPEC])
                                          for item in dataclasses.fields(cls) if SPEC in item.metadata]
    specs += [(name, typing.get_type_hints(member.fget).get("return", Any), member.spec)
              for name, member in vars(cls).items() if isinstance(member, Computed) and member.fget is not None]
    found = []
    for name, annotation, spec in sorted(specs, key=lambda item: item[2].order):
        key = spec.key or name
        schema = _field(key, annotation, spec, cls.__name__)
        found.append(Declared(key, name, spec, schema, _column(key, spec, schema)))
    return found


def declarations(cls: type) -> list[Declared]:
    """The payload fields of a Payload class."""
    declared: list[Declared] = cls.__dict__["__declared__"]
    return declared


def record_fields(cls: type) -> dict[str, Field]:
    """A record's payload fields as schema fields (a spread one's fields in its place)."""
    out: dict[str, Field] = {}
    for item in declarations(cls):
        out.update(item.field.fields or {} if item.spec.spread else {item.key: item.field})
    return out


def record_patterns(cls: type) -> dict[str, Field]:
    """The patterns of a record's spread fields (fields named by a regular expression)."""
    return {pattern: field for item in declarations(cls) if item.spec.spread
            for pattern, field in (item.field.patterns or {}).items()}


def record_field(cls: type, description: str) -> Field:
    """A record as an object field of another payload."""
    return Field("object", description, fields=record_fields(cls), patterns=record_patterns(cls) or None)


def columns(*parts: type | Mapping[str, Field]) -> dict[str, Field]:
    """Frame columns: each part a record (its fields declared `column=`) or a dict of columns, in order."""
    out: dict[str, Field] = {}
    for part in parts:
        if isinstance(part, Mapping):
            out.update(part)
        else:
            out.update({item.key: item.column for item in declarations(part) if item.column is not None})
    return out


_LEAVES = (float, int, str, type(None))  # what a payload holds as it is (bool is an int)


def plain(value: Any) -> Any:
    """A value as a payload holds it: records as their dicts, inside lists, tuples and dicts too."""
    if isinstance(value, Payload):
        return value.to_dict()
    if isinstance(value, list):
        if all(isinstance(item, _LEAVES) for item in value):  # a row of numbers (a heatmap's: 256 x 256 per head)
            return list(value)
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    return value


def _left_out(value: Any, omit: str) -> bool:
    if value is None:
        return True
    return omit == "empty" and isinstance(value, (str, list, tuple, dict)) and not value


@dataclass_transform(field_specifiers=(schema_field, dataclasses.field))
class Payload:
    """A dataclass whose declared fields are a payload, or a nested object of one; `to_dict()` gives it."""

    __declared__: ClassVar[list[Declared]]

    def __init_subclass__(cls, *, frozen: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=frozen)(cls)
        cls.__declared__ = _declarations(cls)

    def to_dict(self) -> dict[str, Any]:
        """The payload: every declared field in order, an optional one left out where it is None or empty."""
        out: dict[str, Any] = {}
        for item in declarations(type(self)):
            value = getattr(self, item.attribute)
            if not item.spec.required and _left_out(value, item.spec.omit):
                continue
            if item.spec.dump is not None:
                value = item.spec.dump(value)
            if item.spec.spread:  # a nested Payload's declared fields (not an override's), or a dict of fields
                out.update(Payload.to_dict(value) if isinstance(value, Payload) else plain(value))
            else:
                out[item.key] = plain(value)
        return out


def published(name: str, version: int, description: str, *, rows: str, columns: Mapping[str, Field],
              column_patterns: Mapping[str, Field] | None = None,
              sections: Mapping[str, Field] | None = None) -> Callable[[type[T]], type[T]]:
    """A Payload class that is the published kind `name`, `version`; `sections`: fields a command adds."""

    def declare(cls: type[T]) -> type[T]:
        fields = {**record_fields(cls), **(sections or {})}
        cls.__kind__ = Kind(name, version, f"{cls.__module__}:{cls.__qualname__}",  # type: ignore[attr-defined]
                            description, fields, rows, dict(columns), record_patterns(cls),
                            dict(column_patterns or {}))
        return cls

    return declare


def declared_kind(cls: type) -> Kind:
    """The kind a `published` class declares."""
    declared: Kind = cls.__dict__["__kind__"]
    return declared
