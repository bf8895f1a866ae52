"""What happens when things break: a stage down, an invalid output, a gateway killed mid-job."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conftest import free_port, write_config
from gateway.client import GatewayClient
from h3serve.v1 import gateway_pb2
from services.common.config import load_deploy
from services.launcher import ServiceGroup

SMALL = dict(prompt="a kite over a beach", height=32, width=64, num_inference_steps=8, seed=11)


def start(root: Path, name: str, names: tuple[str, ...], model_dir: str, ports: dict[str, int]) -> ServiceGroup:
    config = write_config(root / f"{name}.toml", model_dir, root / name, ports, retry_attempts=2,
                          retry_backoff_s=0.1)
    group = ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=names)
    group.__enter__()
    return group


def test_a_stage_that_is_down_fails_the_job_unavailable(stack, tmp_path):
    ports = {**stack.ports, "dit": free_port(), "gateway": free_port()}  # nothing listens on this dit port
    group = start(tmp_path, "gw", ("gateway",), str(stack.model_dir), ports)
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


def test_a_job_in_flight_when_the_gateway_dies_is_failed_with_the_reason(stack):
    client = GatewayClient(stack.address("gateway"))
    request = gateway_pb2.GenerateRequest(prompt="a slow one", height=256, width=448, num_inference_steps=80,
                                          seed=2)
    seen = threading.Event()
    job_id = []

    def follow():
        try:
            for event in client.stub.Generate(request):
                job_id.append(event.job_id)
                if event.HasField("denoising"):
                    seen.set()
        except Exception:  # the stream breaks when the gateway is killed
            seen.set()

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    assert seen.wait(60), "no denoise step arrived"
    stack.group.restart("gateway", signal.SIGKILL)
    thread.join(30)
    client.close()
    client = GatewayClient(stack.address("gateway"))
    try:
        job = client.job(job_id[0])
    finally:
        client.close()
    assert job.state == gateway_pb2.JOB_STATE_FAILED
    assert job.error.code_name == "ABORTED" and "restarted" in job.error.message
