"""Typed configuration: YAML into small per-component dataclasses, with dotted overrides.

Each package owns its config dataclass (``broker.config.BrokerConfig`` ...). Every field carries a
one-line docstring (the string literal right below it), which ``field_docs`` reads for ``--help`` output
and which a test enforces. Unknown keys are errors that name the key's full dotted path.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the offending key."""


def parse_overrides(items: Iterable[str]) -> list[tuple[list[str], Any, str]]:
    """``["broker.eta=2", ...]`` -> ``[(["broker", "eta"], 2, "2"), ...]`` (values parsed as YAML scalars)."""
    parsed = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} has an empty key part")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({exc.problem})") from None
        parsed.append((key.split("."), value, raw))
    return parsed


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Apply dotted overrides onto a nested dict (validation happens when the dataclass is built)."""
    for parts, value, raw in parse_overrides(overrides):
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {'.'.join(parts)}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        # Keep the raw text too, so a str field given "007" or "on" receives exactly what was typed.
        node[parts[-1]] = _RawOverride(value, raw)
    return data


MOVED_KEYS: dict[str, str] = {
    "broker.drop_zero_variance": "renamed broker.dynamic_sampling (the learner's own rule is "
                                 "learner.advantage.drop_zero_variance)",
    "broker.drop_incomplete": "removed: an incomplete group is always dropped (the learner could never train it)",
}
"""keys an earlier version read, and what became of them: a config that still sets one is told where it went"""


@dataclasses.dataclass
class _RawOverride:
    value: Any
    raw: str


def build(cls: type[T], data: dict | None, path: str = "") -> T:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys and ill-typed values."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        if where in MOVED_KEYS:
            raise ConfigError(f"config key '{where}': {MOVED_KEYS[where]}")
        raise ConfigError(f"unknown config key '{where}' (known keys here: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        key_path = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], key_path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key '{key_path}'")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{path or cls.__name__}: {exc}") from None
    return obj


def _convert(value: Any, tp: Any, path: str) -> Any:
    raw_text = None
    if isinstance(value, _RawOverride):
        value, raw_text = value.value, value.raw
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        return build(tp, value, path)
    if origin is Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (raw_text is not None and raw_text.strip().lower() in ("null", "none", "~")):
            return None
        return _convert(value if raw_text is None else _RawOverride(value, raw_text), args[0], path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if raw_text is not None and raw_text in choices:
            return raw_text
        if value not in choices:
            raise ConfigError(f"config key '{path}': {value!r} is not one of {list(choices)}")
        return value
    if tp is str:
        if raw_text is not None:
            return raw_text
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on/yes/no as a boolean
            raise ConfigError(f"config key '{path}': expected a string, got {value!r} (YAML reads a bare "
                              f"off/on/yes/no as a boolean: quote the word, e.g. \"off\")")
        if not isinstance(value, str):
            raise ConfigError(f"config key '{path}': expected a string, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{path}': expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{path}': expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 5e-5 (no dot) as a string; a user means the number
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{path}': expected a number, got {value!r}")
        return float(value)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key '{path}': expected a list, got {value!r}")
        args = typing.get_args(tp)
        return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{path}': expected a mapping, got {value!r}")
        args = typing.get_args(tp)
        if args:
            return {k: _convert(v, args[1], f"{path}.{k}") for k, v in value.items()}
        return {k: (v.value if isinstance(v, _RawOverride) else v) for k, v in value.items()}
    if tp is Any:
        return value
    raise ConfigError(f"config key '{path}': unsupported type {tp}")


def load(cls: type[T], path: str | Path | None = None, overrides: Iterable[str] = (), data: dict | None = None) -> T:
    """Load ``cls`` from a YAML file (or a dict), then apply dotted ``key=value`` overrides."""
    if path is not None:
        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    data = apply_overrides(dict(data or {}), overrides)
    return build(cls, data)


def to_dict(cfg: Any) -> Any:
    """A plain nested dict of a config (for YAML/JSON output)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def flatten(cfg: Any) -> dict[str, Any]:
    """A config's leaves by dotted key (``{"learner.lr": 3e-4, ...}``); a list is one leaf."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(to_dict(cfg), "")
    return out


def differences(a: Any, b: Any) -> dict[str, tuple[Any, Any]]:
    """The dotted keys where two configs differ, with ``a``'s value and ``b``'s (None where one has no such key)."""
    fa, fb = flatten(a), flatten(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def dump(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(path)


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring under each field of a dataclass, keyed by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                    and isinstance(nxt.value.value, str):
                docs[node.target.id] = nxt.value.value.strip()
    return docs


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """Flatten a config class into ``(dotted key, type, default, doc)`` rows (for ``computerrl config``)."""
    rows = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        rows.append((key, getattr(tp, "__name__", str(tp)), default, docs.get(f.name, "")))
    return rows
