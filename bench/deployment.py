"""Deployments the CPU benches start: loopback ports, the built-in tiny model saved once, a data directory of
their own."""

from __future__ import annotations

import platform
import tomllib
from datetime import date
from pathlib import Path

from bench.results import Record, command_line
from h3serve.common.config import DeployConfig, load_deploy
from h3serve.common.deploy_toml import dumps
from h3serve.common.free_ports import free_port

DEMO = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "tiny-cpu.toml"
MODEL_SERVICES = ("encoder", "dit", "vae")


def tiny_deployment(root: Path, base: DeployConfig | None = None) -> Path:
    """A deployment of the tiny model saved under `root`, on free ports, with `base`'s geometry, threads and
    default steps (default: the demo's, docs/deploy/tiny-cpu.toml); every other setting is the shipped
    default."""
    from h3serve.runtime.tiny import write_tiny_model

    base = base or load_deploy(DEMO)
    model = write_tiny_model(root / "tiny-h3")
    sections: dict[str, dict] = {"model": {"dir": str(model), **base.gateway.geometry.pipeline_configs()}}
    for name in MODEL_SERVICES:
        sections[name] = {"port": free_port(), "threads": base.service(name).threads}
    sections["gateway"] = {
        "port": free_port(),
        "data_dir": str(root / "gateway"),
        "default_steps": base.gateway.default_steps,
    }
    path = root / "deploy.toml"
    path.write_text(dumps(sections))
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
    path.write_text(dumps(data))
    return path


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
