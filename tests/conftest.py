"""Shared fixtures: the tiny model on disk and a real four-process stack on loopback ports."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.config import load_deploy
from services.launcher import ServiceGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_values(values: dict) -> str:
    return "".join(f"\n{key} = {str(value).lower() if isinstance(value, bool) else repr(value)}".replace("'", '"')
                   for key, value in values.items())


def write_config(path: Path, model_dir: str, data_dir: Path, ports: dict[str, int], model: dict | None = None,
                 dit: dict | None = None, **gateway) -> Path:
    """A deployment file: every section on loopback; extra [model], [dit] and [gateway] keys from
    `model`, `dit` and `gateway`."""
    lines = [f'[model]\ndir = "{model_dir}"' + toml_values(model or {})]
    for name in ("encoder", "dit", "vae"):
        lines.append(f"[{name}]\nport = {ports[name]}" + (toml_values(dit or {}) if name == "dit" else ""))
    extra = toml_values(gateway)
    lines.append(f'[gateway]\nport = {ports["gateway"]}\ndata_dir = "{data_dir}"{extra}')
    path.write_text("\n\n".join(lines) + "\n")
    return path


@dataclass
class Stack:
    config_path: Path
    group: ServiceGroup
    model_dir: Path
    ports: dict[str, int]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from services.common.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-h3")


@pytest.fixture(scope="session")
def stack(tmp_path_factory, tiny_model_dir):
    """Encoder, DiT, VAE and gateway as real processes, loading the tiny model from its directory."""
    root = tmp_path_factory.mktemp("stack")
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    config_path = write_config(root / "deploy.toml", str(tiny_model_dir), root / "gateway", ports,
                               retry_attempts=2, retry_backoff_s=0.1)
    group = ServiceGroup(load_deploy(config_path), str(config_path), log_dir=str(root))
    with group:
        yield Stack(config_path, group, tiny_model_dir, ports)
