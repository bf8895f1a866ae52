"""Shared fixtures: the tiny model on disk, a real four-process stack on loopback ports, the fork server, the DiT's
hold point. Their helpers live by concern beside this file: deployments.py (deployment files, Stack), ordering.py
(tiers and module order), dit_holding.py, forked.py (commands as forks), stores.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# Inductor's CPU compiles (the compile tests and the compiled DiTs they start) probe which vector instruction sets
# the compiler and CPU take by building and loading a test kernel per set, once per process and compile cache
# directory: about 9 s of every cold compile of the tiny DiT here, and the tests compile into fresh caches on purpose.
# The sets are taken from the CPU's flags instead. Set before torch is imported, here and in every process started.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import ordering
from deployments import (
    ADAPTER_GEOMETRY,
    ADAPTER_SIDECAR,
    QUICK_OUTAGE,
    STACK_CAPACITY,
    STACK_MODEL,
    Stack,
    write_config,
)
from dit_holding import HOLD_STEP, DitHold

from h3serve.cli.launcher import ServiceGroup
from h3serve.common import forkserver
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.services import preload
from h3serve.services.dit import hold


def pytest_collection_modifyitems(items) -> None:
    ordering.order(items)


@pytest.fixture(scope="session")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate and key for localhost / 127.0.0.1 (openssl from the OS)."""
    root = tmp_path_factory.mktemp("tls")
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[forkserver.ForkServer]:
    """One fork server for every stack this test process starts (its environment names it): each model process and
    restart is a fork of it instead of 10-12 s of imports. `h3serve up` as a user runs it (up_process.py) starts its
    own, as it would for a user."""
    server = forkserver.ForkServer.launch(preload.__name__)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(forkserver.ENV, server.path)
        yield server
    server.stop()


@pytest.fixture(scope="session")
def dit_hold(tmp_path_factory) -> Iterator[DitHold]:
    """The hold point, set in the environment of every process started after this fixture: a fixture or test that
    starts a DiT and holds its jobs asks for it first (`stack` does)."""
    point = hold.Hold(HOLD_STEP, tmp_path_factory.mktemp("dit-hold") / "gate")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(hold.ENV, point.setting)
        yield DitHold(point)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from h3serve.runtime.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-h3")


@pytest.fixture(scope="session")
def stack(tmp_path_factory, tiny_model_dir, dit_hold):
    """Encoder, DiT, VAE and gateway as real processes, loading the tiny model from its directory; started after
    `dit_hold`, so its DiT, and those tests start beside it, hold jobs while it is armed."""
    root = tmp_path_factory.mktemp("stack")
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway", "metrics", "http")}
    config_path = write_config(
        root / "deploy.toml",
        str(tiny_model_dir),
        root / "gateway",
        ports,
        model=STACK_MODEL,
        outage_s=QUICK_OUTAGE,
        retry_backoff_s=0.1,
        metrics_port=ports["metrics"],
        http_port=ports["http"],
        capacity=STACK_CAPACITY,
    )
    group = ServiceGroup(load_deploy(config_path), str(config_path), log_dir=str(root))
    with group:
        yield Stack(config_path, group, tiny_model_dir, ports)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """torchao refuses fp8 on a CPU only by a hardware check; its fp8 linear runs here."""
    from torchao.quantization import quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)


@pytest.fixture
def loads(monkeypatch) -> list[list[str]]:
    """The component names each DiT start loads (or builds) through the model source."""
    from h3serve.services.dit import rank

    calls: list[list[str]] = []
    load_model_service = rank.load_model_service

    def recording(service, names, config):
        calls.append(list(names))
        return load_model_service(service, names, config)

    monkeypatch.setattr(rank, "load_model_service", recording)
    return calls


@pytest.fixture(scope="session")
def adapter_stack(tmp_path_factory, tiny_model_dir):
    """A second four-process stack (with the HTTP door) whose DiT loads tiny random LoRA adapters: turbo (rank 4,
    alpha 8: scale 2, ADAPTER_SIDECAR), style (rank 4, alpha 2: scale 0.5; the original single-file layout) and
    refstyle (rank 2 on transformer_ref: ref2va), with the canvas shrunk so keyframes and references stay small."""
    from lora_files import diffusers_lora, original_lora

    from h3serve.model.rules import Geometry

    root = tmp_path_factory.mktemp("adapter-stack")
    loras = {
        "turbo": str(diffusers_lora(root / "turbo", 1, 4, 8.0, sidecar=ADAPTER_SIDECAR)),
        "style": str(original_lora(root / "style.safetensors", 2, 4, 2.0)),
        "refstyle": str(diffusers_lora(root / "refstyle", 3, 2, 1.0, partition="transformer_ref")),
    }
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway", "http")}
    geometry = Geometry(**ADAPTER_GEOMETRY)
    config_path = write_config(
        root / "deploy.toml",
        str(tiny_model_dir),
        root / "gateway",
        ports,
        model=geometry.pipeline_configs(),
        dit={"adapters": loras},
        max_rows=1000,
        http_port=ports["http"],
    )
    group = ServiceGroup(load_deploy(config_path), str(config_path), log_dir=str(root))
    with group:
        yield Stack(config_path, group, tiny_model_dir, ports)
