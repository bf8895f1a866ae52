"""Shared fixtures: the tiny model on disk and a real four-process stack on loopback ports."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

# Inductor's CPU compiles (the compile tests and the compiled DiTs they start) probe which vector instruction sets
# the compiler and CPU take by building and loading a test kernel per set, once per process and compile cache
# directory: about 9 s of every cold compile of the tiny DiT here, and the tests compile into fresh caches on purpose.
# The sets are taken from the CPU's flags instead. Set before torch is imported, here and in every process started.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

from bench.deployment import toml_value
from h3serve.cli.launcher import ServiceGroup
from h3serve.common import forkserver
from h3serve.common.config import load_deploy
from h3serve.services import preload
from h3serve.services.dit import hold
from h3serve.v1 import gateway_pb2

# The ports the tests' servers listen on come from a block of this pytest worker's own, below the kernel's ephemeral
# range (32768-60999 by default). The kernel's bind(0) can hand out a port as free that another free_port() of this
# worker or the other's has just handed out too, not yet bound (the likeliest cause of CI's shared stack once losing
# its gateway at start). A process started by a test (tests/up_process.py) walks the block from another point.
PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def _port_block() -> range:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = len(PORTS) // workers
    return range(PORTS.start + worker * size, PORTS.start + (worker + 1) * size)


def free_port() -> int:
    """A loopback port nothing listens on that no earlier call of this process handed out."""
    block = _port_block()
    start = os.getpid() * 7919 % len(block)  # a prime stride: processes of one worker start apart
    for step in range(len(block)):
        port = block[(start + step) % len(block)]
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port left in {block}")


def write_config(
    path: Path,
    model_dir: str,
    data_dir: Path,
    ports: dict[str, int],
    model: dict | None = None,
    service_keys: dict | None = None,
    dit: dict | None = None,
    **gateway,
) -> Path:
    """A deployment file: every section on loopback, extra [model] keys from `model`, `service_keys` in each
    model service section, `dit` in [dit] only, the gateway's keys from `gateway`."""
    lines = [f'[model]\ndir = "{model_dir}"' + "".join(f"\n{key} = {value!r}" for key, value in (model or {}).items())]
    for name in ("encoder", "dit", "vae"):
        keys = {**(service_keys or {}), **((dit or {}) if name == "dit" else {})}
        lines.append(
            f"[{name}]\nport = {ports[name]}" + "".join(f"\n{key} = {toml_value(value)}" for key, value in keys.items())
        )
    extra = "".join(f"\n{key} = {toml_value(value)}" for key, value in gateway.items())
    lines.append(f'[gateway]\nport = {ports["gateway"]}\ndata_dir = "{data_dir}"{extra}')
    path.write_text("\n\n".join(lines) + "\n")
    return path


# Test deployments give up on a stage that stays down after a second (the shipped defaults wait minutes).
QUICK_OUTAGE = {stage: 1.0 for stage in ("encoder", "vae-encode", "dit", "vae")}

# The stack's image references are encoded at a 64 px short edge: the released 2048 px took 17 s per image on CPU.
STACK_MODEL = {"reference_image_short_edge": 64}

# The stack's admission table: one canvas no other test uses, so only the admission test meets the limit.
STACK_CAPACITY = {"t2va": {"512x512": 20000}}


@dataclass
class Stack:
    config_path: Path
    group: ServiceGroup
    model_dir: Path
    ports: dict[str, int]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    @property
    def http(self) -> str:
        """Base URL of the gateway's HTTP door (OpenAI /v1/videos, SSE, the console)."""
        return f"http://127.0.0.1:{self.ports['http']}"


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


def with_store(path: Path, scenario) -> None:
    """Run `await scenario(store)` on a fresh SqliteJobStore at `path`, closed afterwards."""
    from h3serve.gateway.jobs.sqlite import SqliteJobStore

    async def go():
        store = SqliteJobStore(str(path))
        try:
            await scenario(store)
        finally:
            await store.close()

    asyncio.run(go())


# `make test-fast` runs the unit tier: every test but those marked `processes` (and the timing, slow and distributed
# tiers). A test that uses a fixture starting services is marked here; a module whose tests or fixtures start
# processes themselves says so (`pytestmark = pytest.mark.processes`).
PROCESS_FIXTURES = {"stack", "adapter_stack"}


# The modules that take longest (`--durations`, summed per module, on the 2-core machine), longest first. Under
# `--dist loadfile --no-loadscope-reorder` (Makefile) the workers take modules in collection order, so these start
# first and the short ones fill in after them: the workers end within seconds of each other. By default xdist orders
# modules by their test count, which put these few-test, minute-long modules last, one worker idle behind them.
LONGEST_FIRST = (
    "test_warmup",
    "test_supervision",
    "test_distributed",
    "test_fault_walk",
    "test_fastpath",
    "test_adapters",
    "test_cli",
    "test_experiment",
    "test_install_extras",
    "test_dit_group",
    "test_bench_sharded",
    "test_fuzz",
    "test_served_adapters",
    "test_bench",
    "test_media",
    "test_console",
    "test_resilience",
    "test_client",
    "test_failures",
    "test_http_door",
)


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
    unknown = [name for name in LONGEST_FIRST if not Path(__file__).with_name(f"{name}.py").exists()]
    if unknown:  # a renamed module would silently go back to the end
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names no test module: {', '.join(unknown)}")
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.stem, len(order)))  # stable: the rest keep collection order


# The denoise step an armed `dit_hold` keeps a job at, and a small job that is mid-denoise there (its 8 steps send 7
# step events: 5 are still to come).
HOLD_STEP = 2
HELD = dict(height=32, width=64, num_inference_steps=8)


class DitHold:
    """The tests' side of the DiT's hold point (h3serve/services/dit/hold.py): inside `armed()`, a job that reaches
    HOLD_STEP waits there until the block ends or its client cancels, so a kill or a cancel made after seeing its
    event for that step (`holds`) provably lands mid-denoise, where a long CPU run only made it likely."""

    def __init__(self, point: hold.Hold) -> None:
        self.point = point

    @contextmanager
    def armed(self) -> Iterator[None]:
        self.point.gate.touch()
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """Let a held job go on now, and the jobs after it run through (inside `armed()` too)."""
        self.point.gate.unlink(missing_ok=True)

    @staticmethod
    def holds(event: gateway_pb2.JobEvent) -> bool:
        """Whether `event` is its job's step at the hold: armed, the job waits there."""
        return event.HasField("denoising") and event.denoising.step == HOLD_STEP


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


def run_forked(
    server: forkserver.ForkServer, argv: list[str], timeout_s: float = 240, check: bool = True
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True)` for `python -m MODULE ...`, as a fork of `server`: the
    model's imports done (a fresh interpreter's `h3serve reference` or `serve dit` spends 10 CPU seconds on them)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = forkserver.start(argv, server, stdout=out, stderr=err)
        try:
            code = child.wait(timeout_s)
        finally:
            child.kill()
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(argv, code, out.read().decode(), err.read().decode())
    if check:
        done.check_returncode()
    return done


def run_ranks(server: forkserver.ForkServer, module: str, args: list[str], world_size: int = 2, timeout_s=420) -> None:
    """`python -m module args` as `world_size` ranks of a standalone group on this host, forks of `server` with
    torchrun's environment, as h3serve's own DiT launcher starts its ranks: torchrun's agent and each rank's imports
    cost 16 CPU seconds a launch. As under torchrun the store is served outside the ranks (here, by this process). A
    rank that fails stops the others, as torchrun. Not for a rank that measures its own host memory: test_sharded_load's
    forked rank 0 measured 48-50 MiB above its shard and block in two full suites (13 MiB alone), over its margin."""
    from torch.distributed import TCPStore

    port = free_port()
    _store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # served while this call runs
    env = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the ranks are the store's clients
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        forkserver.start(
            [sys.executable, "-m", module, *args],
            server,
            death_signal=signal.SIGKILL,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        while (codes := [rank.poll() for rank in ranks]).count(0) < world_size:
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            assert not failed, f"{module}: rank(s) failed (rank, exit code): {failed}"
            assert time.monotonic() < deadline, f"{module}: the ranks did not finish in {timeout_s} s"
            time.sleep(0.2)
    finally:
        for rank in ranks:
            rank.kill()


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


# The adapter stack's LoRA files: turbo's sidecar recommends steps and shifts (what a request leaving them unset gets).
ADAPTER_SIDECAR = {"steps": 3, "flow_shift": 6.0, "audio_flow_shift": 2.5}
# Its canvas, shrunk so that keyframes and references stay small on CPU (model.rules.Geometry's fields).
ADAPTER_GEOMETRY = dict(canvas_short_edge=32, canvas_max_pixels=2048, reference_image_short_edge=64)


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
