"""Deployment files written from Python values: the one TOML writer the tests and benches use to make the
deployments they start (the gateway and services only read them, with tomllib)."""

from __future__ import annotations

import json


def toml_value(value) -> str:
    """A value of the kinds deployment files use (bool, number, str, list, dict) as TOML; strings as JSON writes
    them (a subset of TOML's), dicts as inline tables."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"


def dumps(sections: dict[str, dict]) -> str:
    """A deployment file: one [section] per entry, its keys in order."""
    return "\n".join(
        f"[{name}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in keys.items())
        for name, keys in sections.items()
    )
