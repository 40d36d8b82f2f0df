"""Config files and command-line overrides: `configs/x.py:arg` loading, `--config.a.b=v`
key checks that name the valid keys, dotted assignments; `load_config` for benchmarks and tests.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from mmr_jax.config import config_checks, config_types


class UnknownKeyError(KeyError):
    """An override names a config key that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0])


def load_config_file(spec: str):
    """'configs/grpo.py:7b,smoke' -> that file's `get_config('7b,smoke')` (a ConfigDict)."""
    import importlib.util
    import pathlib

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    if module_spec is None or not pathlib.Path(path).exists():
        raise FileNotFoundError(f"config file {path!r} not found")
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
            raise ValueError(f"expected name=value, got {item!r}")
        if raw.lower() in ("true", "false"):
            parsed[name] = raw.lower() == "true"
            continue
        try:
            parsed[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            parsed[name] = raw
    return parsed


def set_keys(config, values: Mapping[str, Any]):
    """Sets dotted keys ('checkpoint.every') of a ConfigDict in place; returns it."""
    for key, value in values.items():
        *sections, leaf = key.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[leaf] = value
    return config


def check_override_keys(argv, flag_name: str = "config") -> None:
    """Raises `UnknownKeyError` naming the valid keys when a `--config.a.b=v` path does not exist.

    Run on argv before absl parses it: ml_collections reports only a close match, not the keys.
    """
    prefix = f"--{flag_name}"
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith(prefix + "=")), None)
    overrides = [a[len(prefix) + 1 :].split("=", 1)[0] for a in argv if a.startswith(prefix + ".")]
    if spec is None or not overrides:
        return
    config = config_checks._plain(load_config_file(spec))
    for path in overrides:
        node, walked = config, []
        for key in path.split("."):
            if not isinstance(node, Mapping) or key not in node:
                where = ".".join(walked) or "<root>"
                valid = sorted(node) if isinstance(node, Mapping) else []
                raise UnknownKeyError(
                    f"unknown config key {path!r}: {where!r} has no key {key!r}; "
                    f"valid keys: {valid}"
                )
            node, walked = node[key], [*walked, key]


def load_config(path: str, overrides: Mapping[str, Any] | None = None) -> config_types.TrainConfig:
    """A config file ('configs/x.py[:arg]') with dotted `overrides` -> the validated TrainConfig."""
    config = load_config_file(path)
    return config_checks.from_config_dict(set_keys(config, overrides or {}))
