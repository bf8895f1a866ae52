"""The DiT service as a 2-rank group (torchrun, gloo, FSDP2 + Ulysses) behind the real gateway.

The encoder and VAE are the session stack's; this module starts its own 2-rank DiT and a
gateway pointed at it. Ranks are killed for real (SIGKILL) in the middle of requests.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch
from deployments import QUICK_OUTAGE, write_config
from dit_holding import HELD, HOLD_STEP
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.cli.launcher import ServiceGroup
from h3serve.cli.reference import ReferenceRequest, base_params, run_reference
from h3serve.client import GatewayClient
from h3serve.common import forkserver
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.runtime import wire
from h3serve.runtime.models import ModelSource
from h3serve.v1 import common_pb2, dit_pb2, dit_pb2_grpc, gateway_pb2

pytestmark = [pytest.mark.distributed, pytest.mark.processes]
PROMPT = "two foxes share a sandwich"
TOLERANCE = 1e-5
DIT2 = dict(world_size=2, fsdp=True, heartbeat_s=1.0, restart_backoff_s=1.0, max_restarts=5, collective_timeout_s=10.0)
LONG = dict(height=256, width=448, num_frames=124, num_inference_steps=60)


@dataclass
class Group:
    dit: dit_pb2_grpc.DiTStub
    address: str
    gateway: GatewayClient

    def info(self) -> dit_pb2.DiTInfo:
        return self.dit.Info(common_pb2.InfoRequest(), timeout=10)

    def idle_info(self, timeout: float = 60.0) -> dit_pb2.DiTInfo:
        """Info once the group has finished what it runs (a cancelled job stops at its next step)."""
        deadline = time.monotonic() + timeout
        while (info := self.info()).busy:
            assert time.monotonic() < deadline, "the DiT group stayed busy"
            time.sleep(0.05)
        return info


@pytest.fixture(scope="module")
def group(stack, tmp_path_factory):
    root = tmp_path_factory.mktemp("dit-group")
    ports = {**stack.ports, "dit": free_port(), "gateway": free_port()}
    config = write_config(
        root / "deploy.toml",
        str(stack.model_dir),
        root / "gateway",
        ports,
        dit=DIT2,
        outage_s={**QUICK_OUTAGE, "dit": 60.0},
        retry_backoff_s=0.5,
    )
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=("dit", "gateway")):
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['dit']}")
        client = GatewayClient(f"127.0.0.1:{ports['gateway']}")
        yield Group(dit_pb2_grpc.DiTStub(channel), f"127.0.0.1:{ports['dit']}", client)
        client.close()
        channel.close()


def test_t2va_with_two_dit_ranks_decodes_to_the_in_process_frames(group, tmp_path):
    final = group.gateway.generate(
        gateway_pb2.GenerateRequest(
            prompt=PROMPT, height=32, width=64, num_inference_steps=8, seed=21, include_raw=True
        )
    )
    assert final.WhichOneof("kind") == "done", final
    served = np.load(group.gateway.download(final.done.raw.artifact_id, tmp_path / "served.npz"))
    expected = run_reference(ModelSource(None), ReferenceRequest(PROMPT, 32, 64, 124, base_params(8, 21)))
    assert served["frames"].shape == expected["frames"].shape == (124, 32, 64, 3)
    assert np.abs(served["frames"] - expected["frames"]).max() <= TOLERANCE
    assert np.abs(served["audio"] - expected["audio"]).max() <= TOLERANCE

    info = group.info()
    assert (info.state, info.world_size, info.ulysses_degree, info.ring_degree, info.fsdp) == ("serving", 2, 2, 1, True)
    assert (info.attention_backend, info.compute_backend, info.model.dtype) == ("native", "gloo", "float32")
    assert [r.rank for r in info.ranks] == [0, 1] and len({r.pid for r in info.ranks}) == 2
    assert all(r.peak_bytes > 0 for r in info.ranks)
    assert {r.steps_served for r in info.ranks} == {info.steps_served} and info.steps_served >= 7


class AtStep:
    """A gateway event callback that runs `action(event)` once, when denoise step `step` arrives."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action, self.fired = step, action, threading.Event()

    def __call__(self, event) -> None:
        if event.HasField("denoising") and event.denoising.step == self.step and not self.fired.is_set():
            self.fired.set()
            self.action(event)


def test_cancel_stops_both_ranks_at_the_same_step_and_the_next_job_runs(group, dit_hold):
    # the group's DiT started after dit_hold (its fixture asks for the stack first), so rank 0 holds the job at
    # HOLD_STEP while the gate is armed: the cancel provably lands there, however slow the machine (a loaded one ran
    # 4 steps of a long job before the cancel arrived)
    before = group.info().steps_served
    cancel = AtStep(HOLD_STEP, lambda e: group.gateway.stub.CancelJob(gateway_pb2.CancelJobRequest(job_id=e.job_id)))
    with dit_hold.armed():
        final = group.gateway.generate(gateway_pb2.GenerateRequest(prompt=PROMPT, **HELD, seed=4), cancel)
    assert cancel.fired.is_set() and final.WhichOneof("kind") == "cancelled", final
    info = group.idle_info()
    ran = info.steps_served - before
    assert 2 <= ran <= 3, f"the group ran {ran} steps; the client cancelled after step 2"
    assert [r.steps_served for r in info.ranks] == [info.steps_served] * 2, "every rank stopped at the same step"
    after = group.gateway.generate(
        gateway_pb2.GenerateRequest(prompt=PROMPT, height=32, width=64, num_inference_steps=4, seed=5)
    )
    assert after.WhichOneof("kind") == "done"


class HealthLog:
    """Polls the DiT's health in the background and records each status it sees in order.

    Its own channel retries a lost connection every 0.1 s (gRPC's default back-off would sleep
    through the short NOT_SERVING window of a restart).
    """

    def __init__(self, address: str) -> None:
        channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
            ],
        )
        self.health, self.seen, self.stop = health_pb2_grpc.HealthStub(channel), [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            try:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    self.health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                )
            except grpc.RpcError as exc:
                status = exc.code().name
            if not self.seen or self.seen[-1] != status:
                self.seen.append(status)
            time.sleep(0.05)

    def wait_serving_again(self, timeout: float) -> None:
        """Until health has left SERVING and come back to it."""
        deadline = time.monotonic() + timeout
        while not (len(self.seen) > 1 and self.seen[-1] == "SERVING"):
            assert time.monotonic() < deadline, f"health did not come back to SERVING: {self.seen}"
            time.sleep(0.1)
        self.stop.set()


def denoise_inputs(steps: int) -> list[dit_pb2.DenoiseInput]:
    spec = dit_pb2.DenoiseSpec(
        job_id="kill-probe",
        height=LONG["height"],
        width=LONG["width"],
        num_frames=124,
        params=common_pb2.GenerationParams(num_inference_steps=steps, seed=9),
    )
    tensors = {"prompt_embeds": torch.randn(1, 12, 32), "text_token_tags": torch.ones(12, dtype=torch.int64)}
    return [dit_pb2.DenoiseInput(spec=spec), *(dit_pb2.DenoiseInput(chunk=c) for c in wire.encode_many(tensors))]


def test_a_killed_rank_fails_the_request_unavailable_and_the_group_comes_back(group):
    before = group.info()
    health = HealthLog(group.address)
    with pytest.raises(grpc.RpcError) as err:
        for event in group.dit.Denoise(iter(denoise_inputs(60)), timeout=120):
            if event.HasField("step") and event.step.step == 2:
                os.kill(before.ranks[1].pid, signal.SIGKILL)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert "DiT group" in err.value.details(), err.value.details()
    health.wait_serving_again(timeout=180)
    assert "NOT_SERVING" in health.seen, health.seen
    after = group.info()
    assert after.state == "serving" and after.restarts == before.restarts + 1
    assert not {r.pid for r in after.ranks} & {r.pid for r in before.ranks}, "every rank was replaced"


def test_a_hung_rank_times_out_the_collective_and_the_group_comes_back(group):
    before = group.info()
    health = HealthLog(group.address)
    hung = before.ranks[1].pid
    try:
        with pytest.raises(grpc.RpcError) as err:
            for event in group.dit.Denoise(iter(denoise_inputs(60)), timeout=120):
                if event.HasField("step") and event.step.step == 2:
                    os.kill(hung, signal.SIGSTOP)
    finally:
        os.kill(hung, signal.SIGCONT)  # so it can take the launcher's SIGTERM
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert "timed out" in err.value.details().lower(), err.value.details()
    health.wait_serving_again(timeout=180)
    assert group.info().restarts == before.restarts + 1


def test_the_gateway_retries_a_job_whose_dit_rank_died_and_it_completes(group, dit_hold):
    ranks = group.info().ranks

    def kill(event) -> None:  # while rank 0 holds the job at HOLD_STEP: the kill provably lands mid-denoise
        os.kill(ranks[1].pid, signal.SIGKILL)
        dit_hold.release()  # rank 0 goes on into the step's vote, which the dead rank fails; the retry runs through

    kill_at = AtStep(HOLD_STEP, kill)
    with dit_hold.armed():
        final = group.gateway.generate(gateway_pb2.GenerateRequest(prompt=PROMPT, **HELD, seed=6), kill_at)
    assert kill_at.fired.is_set()
    assert final.WhichOneof("kind") == "done", final
    assert group.gateway.job(final.job_id).state == gateway_pb2.JOB_STATE_SUCCEEDED
    assert group.info().state == "serving"


def test_an_unusable_attention_backend_fails_the_start_with_the_reason(fork_server, tmp_path):
    # a fork of the session's fork server (h3serve/common/forkserver.py), as `h3serve up` starts it: what it checks is
    # the DiT's own start, not a fresh interpreter's imports of the CLI
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        started = forkserver.start(
            [
                sys.executable,
                "-m",
                "h3serve.cli",
                "serve",
                "dit",
                "--world-size",
                "2",
                "--port",
                str(free_port()),
                "--attention-backend",
                "flash",
            ],
            fork_server,
            stdout=stdout,
            stderr=stderr,
        )
        returncode = started.wait(120)
    stderr_text = err.read_text()
    assert returncode != 0
    assert "attention backend 'flash'" in stderr_text and "flash-attn" in stderr_text, stderr_text[-2000:]
