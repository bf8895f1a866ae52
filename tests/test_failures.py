"""What happens when things break: a stage down, an invalid output, a gateway killed mid-job."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from deployments import QUICK_OUTAGE, write_config
from dit_holding import HELD
from safetensors.torch import load_file, save_file

from h3serve.cli.launcher import ServiceGroup, is_answering, is_serving
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.gateway.jobs.runner import INTERRUPTED, MAX_RESTART_RERUNS
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

SMALL = dict(prompt="a kite over a beach", height=32, width=64, num_inference_steps=8, seed=11)


def start(
    root: Path, name: str, names: tuple[str, ...], model_dir: str, ports: dict[str, int], ready=is_serving
) -> ServiceGroup:
    config = write_config(
        root / f"{name}.toml", model_dir, root / name, ports, outage_s=QUICK_OUTAGE, retry_backoff_s=0.1
    )
    group = ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=names, ready=ready)
    group.__enter__()
    return group


def test_a_stage_that_is_down_fails_the_job_unavailable(stack, tmp_path):
    ports = {**stack.ports, "dit": free_port(), "gateway": free_port()}  # nothing listens on this dit port
    group = start(tmp_path, "gw", ("gateway",), str(stack.model_dir), ports, ready=is_answering)
    client = GatewayClient(f"127.0.0.1:{ports['gateway']}")
    try:
        final = client.generate(gateway_pb2.GenerateRequest(**SMALL))
        job = client.job(final.job_id)
    finally:
        client.close()
        group.stop()
    assert final.WhichOneof("kind") == "failed"
    assert final.failed.code_name == "UNAVAILABLE" and str(ports["dit"]) in final.failed.message
    assert job.state == gateway_pb2.JOB_STATE_FAILED and job.error.code_name == "UNAVAILABLE"


def broken_vae_model(source: Path, target: Path) -> Path:
    """A copy of the tiny model whose video decoder's output layer is zero: every frame is constant."""
    target.mkdir()
    for entry in source.iterdir():
        (target / entry.name).symlink_to(entry)
    (target / "vae").unlink()
    (target / "vae").mkdir()
    (target / "vae" / "config.json").symlink_to(source / "vae" / "config.json")
    weights = load_file(source / "vae" / "diffusion_pytorch_model.safetensors")
    for name in [n for n in weights if n.startswith("decoder.proj_out.")]:
        weights[name] = torch.zeros_like(weights[name])
    save_file(weights, target / "vae" / "diffusion_pytorch_model.safetensors")
    return target


def test_an_invalid_decoded_video_fails_the_job(stack, tmp_path):
    model = broken_vae_model(stack.model_dir, tmp_path / "broken")
    ports = {**stack.ports, "vae": free_port(), "gateway": free_port()}
    group = start(tmp_path, "gw", ("vae", "gateway"), str(model), ports)
    client = GatewayClient(f"127.0.0.1:{ports['gateway']}")
    try:
        final = client.generate(gateway_pb2.GenerateRequest(**SMALL))
    finally:
        client.close()
        group.stop()
    assert final.WhichOneof("kind") == "failed"
    assert final.failed.code_name == "FAILED_PRECONDITION"
    assert "constant" in final.failed.message


def test_finished_jobs_survive_a_gateway_restart(stack, tmp_path):
    client = GatewayClient(stack.address("gateway"))
    final = client.generate(gateway_pb2.GenerateRequest(**SMALL))
    client.close()
    assert final.WhichOneof("kind") == "done"
    stack.group.restart("gateway", signal.SIGKILL)
    client = GatewayClient(stack.address("gateway"))
    try:
        job = client.job(final.job_id)
        path = client.download(final.done.video.artifact_id, tmp_path / "again.mp4")
    finally:
        client.close()
    assert job.state == gateway_pb2.JOB_STATE_SUCCEEDED
    assert path.stat().st_size == final.done.video.bytes


def interrupt_mid_denoise(stack, dit_hold, request: gateway_pb2.GenerateRequest, signum: int):
    """Submit `request` and restart the gateway with `signum` while the DiT holds it mid-denoise: (job, the event of
    the step it is held at)."""
    client = GatewayClient(stack.address("gateway"))
    with dit_hold.armed():
        job = client.stub.Submit(request)
        assert job.state in (gateway_pb2.JOB_STATE_QUEUED, gateway_pb2.JOB_STATE_RUNNING)
        stream = client.stub.Watch(gateway_pb2.WatchRequest(job_id=job.job_id))
        held = next(e for e in stream if dit_hold.holds(e))
        stack.group.restart("gateway", signum)
    stream.cancel()
    client.close()
    return job, held


@pytest.mark.gateway
def test_a_job_in_flight_when_the_gateway_is_killed_runs_again_to_the_same_result(stack, dit_hold, tmp_path):
    request = gateway_pb2.GenerateRequest(prompt="a slow one", **HELD, seed=2, include_raw=True)
    job, held = interrupt_mid_denoise(stack, dit_hold, request, signal.SIGKILL)  # no terminal event was written

    client = GatewayClient(stack.address("gateway"))
    try:
        events = list(client.stub.Watch(gateway_pb2.WatchRequest(job_id=job.job_id)))
        rerun = client.job(job.job_id)
        again = client.generate(request)
        served = np.load(client.download(events[-1].done.raw.artifact_id, tmp_path / "rerun.npz"))
        expected = np.load(client.download(again.done.raw.artifact_id, tmp_path / "again.npz"))
    finally:
        client.close()
    kinds = [e.WhichOneof("kind") for e in events]
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), "nothing lost, nothing repeated"
    assert held.seq < kinds.index("retrying") + 1 and kinds[-1] == "done"
    assert kinds.count("accepted") == 1 and kinds.count("retrying") == 1
    # A restart spends no attempt: the killed run is re-run 1 of MAX_RESTART_RERUNS, the job still on attempt 1.
    assert events[kinds.index("retrying")].retrying == gateway_pb2.Retrying(
        attempt=1,
        max_attempts=3,
        reason=f"the gateway restarted while this job was in the dit stage; re-run 1 of "
        f"{MAX_RESTART_RERUNS} after a restart; attempt not counted",
    )
    assert rerun.state == gateway_pb2.JOB_STATE_SUCCEEDED and rerun.attempts == 1
    assert [(r.stage, r.attempt, r.finished > 0, r.error) for r in rerun.stage_records] == [
        ("encoder", 1, True, ""),
        ("dit", 1, False, INTERRUPTED),  # the pass the dead gateway left open
        ("encoder", 1, True, ""),
        ("dit", 1, True, ""),
        ("vae", 1, True, ""),
    ]
    assert np.array_equal(served["frames"], expected["frames"]) and np.array_equal(served["audio"], expected["audio"])


@pytest.mark.gateway
def test_a_graceful_gateway_stop_requeues_the_job_in_flight_without_using_an_attempt(stack, dit_hold):
    request = gateway_pb2.GenerateRequest(prompt="a stopped one", **HELD, seed=3)
    job, _ = interrupt_mid_denoise(stack, dit_hold, request, signal.SIGTERM)  # through the shutdown path

    client = GatewayClient(stack.address("gateway"))
    try:
        events = list(client.stub.Watch(gateway_pb2.WatchRequest(job_id=job.job_id)))
        rerun = client.job(job.job_id)
    finally:
        client.close()
    kinds = [e.WhichOneof("kind") for e in events]
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), "nothing lost, nothing repeated"
    assert kinds.count("retrying") == 1 and kinds[-1] == "done"
    assert events[kinds.index("retrying")].retrying == gateway_pb2.Retrying(
        attempt=1,
        max_attempts=3,
        reason="the gateway shut down while this job was in the dit stage; attempt not counted",
    )
    assert rerun.state == gateway_pb2.JOB_STATE_SUCCEEDED and rerun.attempts == 1
    assert [(r.stage, r.attempt, r.finished > 0) for r in rerun.stage_records] == [
        ("encoder", 1, True),
        ("dit", 1, False),
        ("encoder", 1, True),
        ("dit", 1, True),
        ("vae", 1, True),
    ]
