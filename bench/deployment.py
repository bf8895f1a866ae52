"""Deployments the CPU benches start: loopback ports, the built-in tiny model saved once, a data directory of
their own."""

from __future__ import annotations

import json
import platform
import socket
import tomllib
from datetime import date
from pathlib import Path

from bench.results import Record, command_line
from h3serve.common.config import DeployConfig, load_deploy

DEMO = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "tiny-cpu.toml"
MODEL_SERVICES = ("encoder", "dit", "vae")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_deployment(root: Path, base: DeployConfig | None = None) -> Path:
    """A deployment of the tiny model saved under `root`, on free ports, with `base`'s geometry, threads and
    default steps (default: the demo's, docs/deploy/tiny-cpu.toml); every other setting is the shipped
    default."""
    from h3serve.runtime.tiny import write_tiny_model

    base = base or load_deploy(DEMO)
    model = write_tiny_model(root / "tiny-h3")
    geometry = base.gateway.geometry.pipeline_configs()
    lines = [f'[model]\ndir = "{model}"', *(f"{k} = {v}" for k, v in geometry.items())]
    lines += [f"\n[{name}]\nport = {free_port()}\nthreads = {base.service(name).threads}" for name in MODEL_SERVICES]
    lines.append(
        f'\n[gateway]\nport = {free_port()}\ndata_dir = "{root / "gateway"}"\n'
        f"default_steps = {base.gateway.default_steps}"
    )
    path = root / "deploy.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def profile_deployment(profile: Path, changes: dict[str, dict], path: Path) -> Path:
    """`profile` (a docs/deploy/*.toml) with `changes` per section merged in and every port a free one, written to
    `path`: the profile's placement and memory settings as they ship, on this machine's loopback."""
    data = tomllib.loads(profile.read_text())
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    for name in (*MODEL_SERVICES, "gateway"):
        data.setdefault(name, {})["port"] = free_port()
    data["gateway"].pop("http_port", None)
    path.write_text(
        "".join(
            f"[{name}]\n" + "".join(f"{key} = {toml_value(value)}\n" for key, value in section.items()) + "\n"
            for name, section in data.items()
        )
    )
    return path


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


def add_request_arguments(parser, steps: int) -> None:
    """The t2va request a CPU bench sends: canvas and steps."""
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=steps)


def cpu_record(bench: str, argv: list[str] | None, **measured) -> Record:
    """A results row of a CPU bench on a tiny deployment; `measured` gives the name, seconds, baseline and
    variant."""
    import torch

    return Record(
        device="cpu (tiny model, 1 thread per service)",
        world_size=1,
        dtype="float32",
        command=command_line(bench, argv),
        date=date.today().isoformat(),
        software=f"torch {torch.__version__}, python {platform.python_version()}",
        **measured,
    )
