"""Deployments the CPU benches start: loopback ports, the built-in tiny model saved once, a data directory of
their own."""

from __future__ import annotations

import socket
from pathlib import Path

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
    lines.append(f'\n[gateway]\nport = {free_port()}\ndata_dir = "{root / "gateway"}"\n'
                 f"default_steps = {base.gateway.default_steps}")
    path = root / "deploy.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
