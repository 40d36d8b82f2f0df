"""Config files and command-line overrides: `configs/x.py:arg` loading, `--config.a.b=v`
checks of the file, the keys (naming the valid ones) and the values' types, each a one-line
`UserError` (`check_argv`); dotted assignments; `load_config` for benchmarks and tests;
`stored_config`, a run's stored config in today's keys.
"""

from __future__ import annotations

import ast
import functools
import pathlib
from collections.abc import Mapping
from typing import Any

from mmr_jax.config import checks, schema
from mmr_jax.infra import user_errors

# Every key with its default, written once (the typed config holds none: `schema`). The package is
# installed editable from the checkout, as for third_party/ (`models.config`).
BASE_CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "base.py"


class UnknownKeyError(user_errors.UserError, KeyError):
    """An override names a config key that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0])


class ConfigFileError(user_errors.UserError, FileNotFoundError):
    """`--config=` names a file that is not there."""


class ConfigValueError(user_errors.UserError, ValueError):
    """An override's value is not of its key's type (`--config.total_steps=abc`)."""


def load_config_file(spec: str):
    """'configs/grpo.py:7b,smoke' -> that file's `get_config('7b,smoke')` (a ConfigDict)."""
    import importlib.util

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    if module_spec is None or not pathlib.Path(path).is_file():
        folder = pathlib.Path(path).parent
        near = sorted(p.name for p in folder.glob("*.py")) if folder.is_dir() else []
        where = f"{folder}/ holds {near}" if near else f"{folder}/ holds no config file"
        raise ConfigFileError(f"config file {path!r} not found; {where} (--config=<file>[:arg])")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def parse_assignments(items) -> dict[str, Any]:
    """['a.b=1024', 'c=false', 'd=/ckpt'] -> {'a.b': 1024, 'c': False, 'd': '/ckpt'}: values as
    Python literals (true / false in any case as bools), else strings; `name=value` is required."""
    parsed = {}
    for item in items:
        name, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise ConfigValueError(f"expected name=value, got {item!r} (e.g. batch.prompts=4)")
        if raw.lower() in ("true", "false"):
            parsed[name] = raw.lower() == "true"
            continue
        try:
            parsed[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            parsed[name] = raw
    return parsed


def set_keys(config, values: Mapping[str, Any]):
    """Sets dotted keys ('checkpoint.every') of a ConfigDict in place; returns it. A section that
    does not exist is an `UnknownKeyError` naming the valid keys (an unknown leaf is refused
    when the config is checked, `checks.from_config_dict`); a renamed key (`checks.RENAMED`) is
    refused naming its new name."""
    for key, value in values.items():
        if key in checks.RENAMED:
            _leaf(checks.plain(config), key)
        *sections, leaf = key.split(".")
        node = config
        for i, section in enumerate(sections):
            if section not in node:
                _leaf(node, ".".join(sections[i:]), walked=sections[:i], full=key)
            node = node[section]
        node[leaf] = value
    return config


def check_argv(argv, flag_name: str = "config") -> None:
    """Checks a command line's `--config=<file>` and its `--config.a.b=v` overrides before absl
    parses it: the file exists, each key exists (`UnknownKeyError` naming the valid keys: absl
    names only a close match) and each value parses as its key's type (`ConfigValueError` with an
    example: absl's error is a traceback)."""
    prefix = f"--{flag_name}"
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith(prefix + "=")), None)
    overrides = [a[len(prefix) + 1 :].split("=", 1) for a in argv if a.startswith(prefix + ".")]
    if spec is None:
        return
    config = checks.plain(load_config_file(spec))
    for key, *raw in overrides:
        value = _leaf(config, key)
        if raw:
            _check_type(key, raw[0], value, spec.partition(":")[0])


check_override_keys = check_argv  # the name scripts used before the values were checked too


def _leaf(config: Mapping[str, Any], path: str, *, walked=(), full: str | None = None) -> Any:
    """The value at dotted `path` under `config` (reached by the keys `walked`, of the key
    `full`); `UnknownKeyError` naming the valid keys where a key is missing."""
    node, walked, full = config, list(walked), full or path
    for key in path.split("."):
        if not hasattr(node, "keys") or key not in node:
            where = ".".join(walked) or "<root>"
            valid = sorted(node.keys()) if hasattr(node, "keys") else []
            renamed = checks.RENAMED.get(full)
            now = f" ({full} is now {renamed})" if renamed else ""
            raise UnknownKeyError(
                f"unknown config key {full!r}: {where!r} has no key {key!r}; valid keys: "
                f"{valid}{now}"
            )
        node, walked = node[key], [*walked, key]
    return node


def _check_type(key: str, raw: str, value: Any, config_file: str) -> None:
    """Raises `ConfigValueError` when absl's parser for `value`'s type (the one ml_collections
    uses for the flag) refuses `raw`."""
    from absl import flags

    example = value
    if isinstance(value, bool):
        kind, parser = "True or False", flags.BooleanParser()
    elif isinstance(value, int):
        kind, parser = "an int", flags.IntegerParser()
    elif isinstance(value, float):
        kind, parser = "a float", flags.FloatParser()
    elif isinstance(value, tuple):  # ml_collections' parser: `+,-` is refused, `"'+','-'"` not
        from ml_collections.config_flags import tuple_parser

        kind, parser = "a tuple", tuple_parser.TupleParser()
        example = '"' + repr(value).replace('"', '\\"') + '"'  # as typed in a shell
    else:
        return
    try:
        parser.parse(raw)
    except (ValueError, TypeError) as e:
        detail = " ".join(str(a) for a in e.args) if isinstance(e.args, tuple) else str(e)
        if isinstance(value, tuple):
            detail = "not a Python tuple: quote each element"
        raise ConfigValueError(
            f"--config.{key}={raw}: {key} takes {kind} ({config_file} sets {value!r}), not "
            f"{raw!r} ({detail}); e.g. --config.{key}={example}"
        ) from e


def load_config(path: str, overrides: Mapping[str, Any] | None = None) -> schema.TrainConfig:
    """A config file ('configs/x.py[:arg]') with dotted `overrides` -> the validated TrainConfig."""
    config = load_config_file(path)
    return checks.from_config_dict(set_keys(config, overrides or {}))


@functools.cache
def _base_text() -> str:
    import json

    return json.dumps(checks.plain(load_config_file(str(BASE_CONFIG))))


def base_config() -> dict[str, Any]:
    """configs/base.py's config as a plain dict: every key at its default."""
    import json

    return json.loads(_base_text())


def stored_config(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict a run stored (its run.json), in today's keys: old names mapped to new ones
    (`checks.upgrade`), and each key added since taken at its default in configs/base.py, which
    is how the run ran (a key is added with the default that keeps what runs did before it)."""
    out = checks.upgrade(stored)
    for name, default in base_config().items():
        if name not in out:
            out[name] = default
        elif isinstance(default, dict) and isinstance(out[name], Mapping):
            out[name] = {**default, **out[name]}  # a section's keys (rewards.weights: one key)
    return out
