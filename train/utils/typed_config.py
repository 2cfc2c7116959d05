"""Typed config sections: each component declares its section as a frozen dataclass whose fields
carry a type, a one-line doc and their checks (`setting(...)`); `build` turns the composed Hydra
config into those objects, refusing what does not fit with the key's full name and an example.

config/grpo.yaml stays the one source of defaults: the dataclasses declare no defaults, so a key
that the YAML lacks is an error here, not a silently different default. What `build` refuses:
- an unknown key (`+actor.lrr=1`), naming the nearest known key of that section;
- a value of the wrong type (`actor.lr=abc`, `actor.mini_batches=1.5`, a bool where a number goes);
- a value outside its bounds or choices (`ge`, `gt`, `le`, `lt`, `choices`);
- whatever a section's own `check()` refuses (relations between its fields), via `SectionError`.
Relations between sections (the data against the world size, a critic only with gae, ...) are
checked by the trainer's config module, which sees every section.

A section is built once, at start-up; components receive their own section (an `ActorConfig`, not
the whole config), so what a component may read is what its class lists.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key is missing, unknown, mistyped or inconsistent; the message names it."""


def fail(key: str, problem: str, example: str | None = None) -> NoReturn:
    """The one message form of every config error: the key, what is wrong, an override that works."""
    msg = f"config key '{key}': {problem}"
    if example:
        msg += f". Example override: {example}"
    raise ConfigError(msg)


class SectionError(Exception):
    """Raised by a section's `check()` for one of its fields; `build` adds the section's path."""

    def __init__(self, field: str, problem: str, example_value: str | None = None) -> None:
        super().__init__(field, problem, example_value)
        self.field, self.problem, self.example_value = field, problem, example_value


@dataclasses.dataclass(frozen=True)
class Setting:
    """What one field takes besides its type. `choices` may be a callable (a registry's names, read
    at each check, so a newly registered estimator is a valid choice with nothing else to edit)."""
    doc: str
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | Callable[[], Sequence[str]] | None = None
    expect: str | None = None  # the "expected ..." phrase, when the generated one would not say enough
    example: str | None = None  # an example value for the error's override (default: from the bounds)

    def choice_list(self) -> tuple[str, ...] | None:
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)


def setting(doc: str, **checks: Any) -> Any:
    """A dataclass field with its doc and checks (see `Setting`); no default (config/grpo.yaml has it)."""
    return dataclasses.field(metadata={"setting": Setting(doc, **checks)})


def setting_of(field: dataclasses.Field) -> Setting:
    found = field.metadata.get("setting")
    if found is None:
        raise TypeError(f"field {field.name} is not declared with setting(...)")
    return found


# ----------------------------------------------------------------------------------------- build

def build(schema: type[T], node: Any, key: str = "") -> T:
    """`node` (a DictConfig or a mapping) as an instance of the dataclass `schema`, every field checked;
    `key` is the section's path in the config (for messages)."""
    _require_section(schema, node, key)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    given = list(node.keys())
    for name in given:
        if name not in fields:
            _unknown(key, str(name), list(fields))
    obj = schema(**{name: _field(schema, node, field, key) for name, field in fields.items()})
    check = getattr(obj, "check", None)
    if check is not None:
        try:
            check()
        except SectionError as e:
            path = f"{key}.{e.field}" if key else e.field
            fail(path, e.problem, None if e.example_value is None else f"{path}={e.example_value}")
    return obj


def build_field(schema: type, node: Any, name: str, key: str) -> Any:
    """One field of `schema` from its section `node`, checked as `build` checks it: for the few keys
    read before the whole config can be loaded (the process group's timeout, the rollout ranks)."""
    field = next((f for f in dataclasses.fields(schema) if f.name == name), None)
    if field is None:
        raise TypeError(f"{schema.__name__} has no field {name}")
    _require_section(schema, node, key)
    return _field(schema, node, field, key)


def _require_section(schema: type, node: Any, key: str) -> None:
    if not _is_mapping(node):
        fail(key or "<root>", f"expected a section of settings ({', '.join(_names(schema))}), got {node!r}")


def _field(schema: type, node: Any, field: dataclasses.Field, key: str) -> Any:
    """The value of `field` in the section `node` (at `key`), checked against its type and setting."""
    path = f"{key}.{field.name}" if key else field.name
    if field.name not in node.keys():
        fail(path, "is missing; every key has its default in config/grpo.yaml (a config that replaces a "
                   "section must keep its keys)")
    return _value(path, _raw(node, field.name), _hints(schema)[field.name], setting_of(field))


def _unknown(key: str, name: str, known: list[str]) -> NoReturn:
    where = f"the section '{key}'" if key else "the config"
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean '{key + '.' if key else ''}{near[0]}'? " if near else ""
    fail(f"{key}.{name}" if key else name, f"is not a setting: {hint}{where} has {', '.join(known)} "
         "(config/grpo.yaml lists them with their defaults)")


def _value(path: str, value: Any, tp: Any, spec: Setting) -> Any:
    kind, optional = _unwrap_optional(tp)
    if value is None:
        if optional or kind is Any:
            return None
        _mismatch(path, value, kind, spec, optional)
    if dataclasses.is_dataclass(kind):
        return build(kind, value, path)
    out = _typed(value, kind)
    if out is _NO:
        _mismatch(path, value, kind, spec, optional)
    choices = spec.choice_list()
    if choices is not None and out not in choices:
        fail(path, f"expected one of {', '.join(choices)}; got {out!r}", f"{path}={spec.example or choices[0]}")
    if _numeric(kind) and not _within(out, spec):
        _mismatch(path, value, kind, spec, optional)
    return out


_NO = object()


def _typed(value: Any, kind: Any) -> Any:
    """`value` as `kind` (plain Python containers), or _NO when it is not one."""
    if kind is Any:
        return plain(value)
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(kind):
            out = _typed(value, member)
            if out is not _NO:
                return out
        return _NO
    if kind is bool:
        return value if isinstance(value, bool) else _NO
    if kind is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if kind is float:  # an int is a valid float and is kept as given (no conversion: numerics unchanged)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO
    if kind is str:  # the command line's `name=2024` arrives as an int
        if isinstance(value, str):
            return value
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO
    if origin is list:
        if _is_mapping(value) or isinstance(value, (str, bytes)) or not _is_sequence(value):
            return _NO
        (item,) = typing.get_args(kind) or (Any,)
        items = [_typed(v, item) for v in value]
        return _NO if any(v is _NO for v in items) else items
    if origin is dict:
        if not _is_mapping(value):
            return _NO
        return {str(k): plain(_raw(value, k)) for k in value.keys()}
    raise TypeError(f"typed_config: unsupported field type {kind!r}")


def _mismatch(path: str, value: Any, kind: Any, spec: Setting, optional: bool) -> NoReturn:
    expected = spec.expect or _expected(kind, spec)
    if optional and not spec.expect:
        expected = "true, false or null" if kind is bool else expected + " or null"
    fail(path, f"expected {expected}, got {value!r}", f"{path}={spec.example or _example(kind, spec)}")


def _expected(kind: Any, spec: Setting) -> str:
    if kind is bool:
        return "true or false"
    if kind is int:
        if spec.ge == 1 and spec.le is None and spec.lt is None:
            return "a positive integer"
        if spec.ge == 0 and spec.le is None and spec.lt is None:
            return "an integer >= 0"
        return "an integer" + _bounds(spec)
    if _numeric(kind):
        return "a number" + _bounds(spec)
    if kind is str:
        return "a string"
    origin = typing.get_origin(kind)
    if origin is list:
        (item,) = typing.get_args(kind) or (Any,)
        return f"a list of {_plural(item)}"
    if origin is dict:
        return "a mapping"
    return " or ".join(_expected(m, spec) for m in typing.get_args(kind)) or str(kind)


def _plural(kind: Any) -> str:
    return {str: "strings", int: "integers", float: "numbers", bool: "booleans"}.get(kind, "values")


def _bounds(spec: Setting) -> str:
    """` > 0`, ` <= 1`, ` in (0, 1]`, or nothing."""
    low = spec.gt if spec.gt is not None else spec.ge
    high = spec.lt if spec.lt is not None else spec.le
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if spec.gt is not None else '>='} {low:g}"
    if low is None:
        return f" {'<' if spec.lt is not None else '<='} {high:g}"
    return (f" in {'(' if spec.gt is not None else '['}{low:g}, {high:g}"
            f"{')' if spec.lt is not None else ']'}")


def _example(kind: Any, spec: Setting) -> str:
    if kind is bool:
        return "true"
    high = spec.le if spec.le is not None else spec.lt
    if _numeric(kind) and high is not None:
        return f"{high:g}"
    low = spec.ge if spec.ge is not None else spec.gt
    if _numeric(kind) and low is not None and low >= 1:
        return f"{low:g}"
    return "1" if _numeric(kind) else "..."


def _within(value: Any, spec: Setting) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return True  # a non-numeric member of a union (checked by its type)
    return ((spec.gt is None or value > spec.gt) and (spec.ge is None or value >= spec.ge)
            and (spec.lt is None or value < spec.lt) and (spec.le is None or value <= spec.le))


def _numeric(kind: Any) -> bool:
    if kind in (int, float):
        return True
    origin = typing.get_origin(kind)
    return origin in (typing.Union, types.UnionType) and all(m in (int, float) for m in typing.get_args(kind))


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True
    return tp, False


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(schema: type) -> dict[str, Any]:
    if schema not in _HINTS:  # a cache of immutable facts about classes, not run state
        _HINTS[schema] = typing.get_type_hints(schema)
    return _HINTS[schema]


def _names(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def _is_mapping(value: Any) -> bool:
    from omegaconf import DictConfig

    return isinstance(value, (Mapping, DictConfig))


def _is_sequence(value: Any) -> bool:
    from omegaconf import ListConfig

    return isinstance(value, (list, tuple, ListConfig))


def _raw(node: Any, name: Any) -> Any:
    """A value with interpolations resolved (`${trainer.experiment_name}`), containers kept as nodes."""
    return node[name]


def plain(value: Any) -> Any:
    """An OmegaConf node as plain Python (interpolations resolved); any other value as it is."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


# ------------------------------------------------------------------------------------------ docs

def describe(schema: type, key: str = "") -> list[tuple[str, str, str]]:
    """(key, type, doc) of every setting under `schema`, nested sections flattened (for docs and tests)."""
    out = []
    hints = _hints(schema)
    for field in dataclasses.fields(schema):
        path = f"{key}.{field.name}" if key else field.name
        kind, optional = _unwrap_optional(hints[field.name])
        if dataclasses.is_dataclass(kind):
            out += describe(kind, path)
        else:
            name = getattr(kind, "__name__", None) if typing.get_origin(kind) is None else None
            out.append((path, (name or str(kind).replace("typing.", "")) + (" | None" if optional else ""),
                        setting_of(field).doc))
    return out
