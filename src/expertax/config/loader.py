"""Loading a config: defaults -> model preset -> user YAML files -> `key=value` overrides."""

from __future__ import annotations

import difflib
import importlib.resources
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from expertax.config.checks import only_with, run_checks
from expertax.config.schema import MESH_AXES, Config
from expertax.errors import ConfigError
from expertax.paths import read_text


def configs_dir() -> Path:
    """The presets folder: packaged in the wheel, or the repository's `configs/` when editable."""
    packaged = Path(str(importlib.resources.files("expertax"))) / "configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[3] / "configs"


def available_models() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "models").glob("*.yml"))


def load_rules(name: str) -> dict[str, tuple[str, ...]]:
    """The logical-axis rules preset `configs/parallel/<name>.yml`: logical name -> mesh axes."""
    folder = configs_dir() / "parallel"
    path = folder / f"{name}.yml"
    if not path.is_file():
        names = sorted(p.stem for p in folder.glob("*.yml"))
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"sharding_rules={name!r} has no preset; {hint}available: {names}")
    rules = {}
    for logical, mesh_axes in read_yaml(path).items():
        mesh_axes = tuple(mesh_axes or ())
        for axis in mesh_axes:
            if axis not in MESH_AXES:
                raise ConfigError(
                    f"sharding_rules={name!r}: {logical} -> {axis!r} is not a mesh axis {MESH_AXES}"
                )
        rules[str(logical)] = mesh_axes
    return rules


def config_rules(c: Config) -> dict[str, tuple[str, ...]]:
    """The rules preset `c.sharding_rules`, with `shard_exp_on_fsdp` applied (exp -> fsdp)."""
    rules = load_rules(c.sharding_rules)
    if c.shard_exp_on_fsdp:
        rules["exp"] = ("fsdp",)
    return rules


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping that gives a key twice (YAML's keys are unique; PyYAML keeps the last)."""

    def __init__(self, key: Any, first: int, again: int):
        super().__init__(f"key {key!r} is given twice (lines {first} and {again})")
        self.key, self.first, self.again = key, first, again


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives a key twice (`DuplicateKeyError`); a key
    merged in with `<<` may still be given again, as YAML's merge means."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKeyError(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the constructor refuses it itself
                break
        return super().construct_mapping(node, deep)


def load_yaml_text(text: str) -> Any:
    """YAML `text` read by the safe loader, a key given twice refused (`UniqueKeyLoader`)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping; a config key's plain (unquoted) value is read as its key's type takes it
    (`run_name: off` is the string "off", not YAML's boolean; see `typed_value`). A folder, a
    device, text that is not UTF-8 or a key given twice is refused naming the file."""
    path = Path(path)
    label = f"config file {str(path)!r}"
    text = read_text(label, path, "give a YAML file of key: value")
    try:
        data = load_yaml_text(text) or {}
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except DuplicateKeyError as e:
        raise ConfigError(f"{label}: {e}; keep one") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{label} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{label} must hold a mapping of key: value")
    for key_node, value_node in node.value if isinstance(node, yaml.MappingNode) else ():
        plain = isinstance(value_node, yaml.ScalarNode) and value_node.style is None
        key = key_node.value
        if plain and key in data:
            data[key] = typed_value(key, value_node.value, data[key])
    return data


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`key=value` strings to a dict; values are parsed as YAML scalars (1, 1e-3, true, bf16),
    except where the key's type would not take that reading and takes text (`typed_value`). A key
    given twice is refused (which one was meant cannot be told)."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        if key in given:
            raise ConfigError(f"{key} is given twice ({given[key]} and {item}); give each key once")
        given[key] = item
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out[key] = typed_value(key, raw.strip(), value)
    return out


def typed_value(key: str, text: str, parsed: Any) -> Any:
    """What the user typed for config key `key`: YAML's reading `parsed` where the key's type
    takes it, else the text itself where the key takes text. `run_name=off` is "off" (YAML 1.1
    reads a boolean, which a string key would refuse), `run_name=1e3` "1e3", `run_name=007`
    "007"; `steps=10` stays 10 and `use_ring_of_experts=off` stays False."""
    field = Config.model_fields.get(key)
    if field is None or isinstance(parsed, str):
        return parsed
    accepted = _accepted_types(field.annotation)
    if any(type(parsed) is t for t in accepted):
        return parsed
    if str in accepted:
        return text
    if isinstance(parsed, bool):  # pydantic would take YAML's `on`/`off` as the number 1/0
        kinds = " or ".join(sorted(t.__name__ for t in accepted if t is not type(None)))
        raise ConfigError(f"{key}={text!r}: expects {kinds or 'a value'}, not a yes/no word")
    return parsed


def _accepted_types(annotation: Any) -> set[type]:
    """The Python types of the values a field's annotation takes (a float field takes ints)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return {type(v) for v in typing.get_args(annotation)}
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_accepted_types(a) for a in typing.get_args(annotation)))
    if annotation is float:
        return {float, int}
    if annotation is None or annotation is type(None):
        return {type(None)}
    return {annotation} if isinstance(annotation, type) else set()


def _check_known_keys(values: Mapping[str, Any], source: str) -> None:
    known = set(Config.model_fields)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = (
                f"; did you mean {close[0]!r}?" if close else "; see `expertax train --help-keys`"
            )
            raise ConfigError(f"unknown key {key!r} in {source}{hint}")


def _model_preset(name: str) -> dict[str, Any]:
    path = configs_dir() / "models" / f"{name}.yml"
    if not path.is_file():
        close = difflib.get_close_matches(name, available_models(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"model_name={name!r} has no preset; {hint}available: {', '.join(available_models())}"
        )
    return read_yaml(path)


def _validation_message(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "config"
    value = first.get("input")
    msg = first["msg"]
    if first["type"] == "literal_error":
        return f"{key}={value!r}: {msg}"
    return f"{key}={value!r}: {msg[0].lower() + msg[1:]}"


def build_fields(values: Mapping[str, Any]) -> Config:
    """Validate a flat mapping into a Config and run the field-against-field checks (the
    subsystems' own: `expertax.preflight.build_config`)."""
    _check_known_keys(values, "config")
    try:
        cfg = Config(**values)
    except ValidationError as e:
        raise ConfigError(_validation_message(e)) from None
    return run_checks(cfg)


def load_fields(*files: str | Path, overrides: Iterable[str] | Mapping[str, Any] = ()) -> Config:
    """Compose defaults, the `model_name` preset, YAML `files` and overrides into a Config, its
    fields checked against each other (the subsystems' checks: `expertax.preflight.load_config`).

    `overrides` is either `key=value` strings (the command line) or a mapping.
    """
    layers: list[tuple[str, dict[str, Any]]] = []
    for f in files:
        layers.append((str(f), read_yaml(f)))
    cli = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides)
    layers.append(("overrides", cli))
    for source, values in layers:
        _check_known_keys(values, source)
    model_name = Config.model_fields["model_name"].default
    for _, values in layers:
        model_name = values.get("model_name", model_name)
    preset = _model_preset(str(model_name))
    merged: dict[str, Any] = {"model_name": model_name, **preset}
    for _, values in layers:
        merged.update(values)
    cfg = build_fields(merged)
    only_with.check_only_with(cfg, {k for _, values in layers for k in values}, preset)
    return cfg


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
