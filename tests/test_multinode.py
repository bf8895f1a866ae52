"""The DiT group across two hosts: two network namespaces (tests/namespaces.py) each run `h3serve serve dit` with
nnodes = 2 (gloo on CPU, the tiny model, torchrun's rendezvous on the first host's address), beside the same group
of two ranks on one node. The served Denoise output is the one-node group's, byte for byte, and a rank killed on the
second host restarts the whole group, as on one node (tests/test_dit_group.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from namespaces import Hosts, Unavailable

from h3serve.common import forkserver
from h3serve.common.config import load_deploy
from h3serve.common.deploy_toml import dumps
from h3serve.common.free_ports import free_port
from h3serve.common.processes import Child
from h3serve.runtime import wire
from h3serve.v1 import common_pb2, dit_pb2, dit_pb2_grpc

pytestmark = [pytest.mark.distributed, pytest.mark.processes]
GROUP = dict(world_size=2, heartbeat_s=1.0, restart_backoff_s=0.5, max_restarts=3, collective_timeout_s=20.0)
START_S = 240.0  # a cold start of two ranks on the loaded 2-core machine, or a restart
CHANNEL_OPTIONS = [
    ("grpc.enable_http_proxy", 0),  # the hosts' addresses are this machine's own
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
]


@dataclass
class Service:
    """One `h3serve serve dit` group, as seen by a client."""

    address: str
    log: Path

    def stub(self) -> dit_pb2_grpc.DiTStub:
        return dit_pb2_grpc.DiTStub(grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS))

    def info(self) -> dit_pb2.DiTInfo:
        return self.stub().Info(common_pb2.InfoRequest(), timeout=5)

    def serving_info(self, restarts: int, timeout: float = START_S) -> dit_pb2.DiTInfo:
        """DiTInfo once the group serves after `restarts` restarts."""
        deadline, seen = time.monotonic() + timeout, "no answer"
        while time.monotonic() < deadline:
            try:
                info = self.info()
                if info.state == "serving" and info.restarts == restarts:
                    return info
                seen = f"{info.state} (restarts {info.restarts})"
            except grpc.RpcError as exc:
                seen = exc.code().name
            time.sleep(0.2)
        raise AssertionError(f"{self.address} did not serve after restart {restarts}: {seen}\n{tail(self.log)}")


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def write_deploy(path: Path, **dit) -> Path:
    path.write_text(dumps({"model": {"dir": ""}, "dit": {**GROUP, **dit}}))
    return path


def stop(process: Child) -> None:
    """SIGTERM to the launcher, which stops its ranks; SIGKILL if it has not exited in 30 s (its ranks die with it:
    a rank's parent-death signal is SIGKILL)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    try:
        with Hosts(2) as made:
            yield made
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def groups(hosts, fork_server, tmp_path_factory) -> Iterator[tuple[Service, Service]]:
    """(two nodes, one node): both started at once, so that their start-ups overlap."""
    root = tmp_path_factory.mktemp("multinode")
    first, port = hosts.address(0), free_port()
    two = write_deploy(root / "two.toml", host=first, port=port, nnodes=2, rdzv_endpoint=f"{first}:{free_port()}")
    one = write_deploy(root / "one.toml", host="127.0.0.1", port=free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the one-node launcher gives its ranks: the same sums
    started: list[Child] = []
    try:
        for node in range(2):
            with open(root / f"node{node}.log", "wb") as log:
                argv = [sys.executable, "-m", "h3serve.cli", "serve", "dit", "--config", str(two)]
                started.append(
                    subprocess.Popen(
                        hosts.run(node, argv), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
        with open(root / "one.log", "wb") as log:
            argv = [sys.executable, "-m", "h3serve.cli", "serve", "dit", "--config", str(one)]
            started.append(forkserver.start(argv, fork_server, stdout=log, stderr=log))
        services = (
            Service(f"{first}:{port}", root / "node0.log"),
            Service(f"127.0.0.1:{load_deploy(one).dit.port}", root / "one.log"),
        )
        for service in services:
            service.serving_info(restarts=0)
        yield services
    finally:
        for process in started:
            stop(process)


def denoise_inputs(job_id: str, height: int, width: int, steps: int) -> list[dit_pb2.DenoiseInput]:
    spec = dit_pb2.DenoiseSpec(
        job_id=job_id,
        height=height,
        width=width,
        num_frames=124,
        params=common_pb2.GenerationParams(num_inference_steps=steps, seed=9),
    )
    generator = torch.Generator().manual_seed(5)
    tensors = {
        "prompt_embeds": torch.randn(1, 12, 32, generator=generator),
        "text_token_tags": torch.ones(12, dtype=torch.int64),
    }
    return [dit_pb2.DenoiseInput(spec=spec), *(dit_pb2.DenoiseInput(chunk=c) for c in wire.encode_many(tensors))]


def served_latents(service: Service) -> list[bytes]:
    """The latents' chunks of one small Denoise, as the wire carries them."""
    events = service.stub().Denoise(iter(denoise_inputs("multinode", 32, 64, 6)), timeout=120)
    return [event.chunk.SerializeToString() for event in events if event.HasField("chunk")]


def test_two_nodes_serve_the_one_node_groups_bytes(groups, hosts):
    two, one = groups
    info = two.info()
    assert (info.world_size, info.compute_backend, [r.rank for r in info.ranks]) == (2, "gloo", [0, 1])
    assert info.ranks[0].pid != info.ranks[1].pid
    served = served_latents(two)
    assert served, "the two-node group sent no latents"
    assert served == served_latents(one), "two nodes and one node gave different bytes"


def test_a_rank_killed_on_the_second_node_restarts_the_group(groups):
    two, one = groups
    before = two.info()
    second = before.ranks[1].pid  # rank 1 runs on the second host (node rank 1); one process-id space for both
    with pytest.raises(grpc.RpcError) as err:
        for event in two.stub().Denoise(iter(denoise_inputs("kill-probe", 256, 448, 60)), timeout=120):
            if event.HasField("step") and event.step.step == 2:
                os.kill(second, signal.SIGKILL)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert "DiT group" in err.value.details(), err.value.details()
    after = two.serving_info(restarts=before.restarts + 1)
    assert not {r.pid for r in after.ranks} & {r.pid for r in before.ranks}, "every rank on both nodes was replaced"
    assert served_latents(two) == served_latents(one), "the restarted group serves the same bytes"
