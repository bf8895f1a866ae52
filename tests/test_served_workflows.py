"""Submit refuses a workflow the deployment's DiT does not serve, from the DiT's own Info (a real stack whose
DiT is configured for t2va only), and accepts as before when no DiT answers."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from deployments import QUICK_OUTAGE, write_config

from bench.media_files import image
from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.gateway.stages.replicas import HEALTH_TTL_S
from h3serve.model.rules import Geometry
from h3serve.v1 import common_pb2, dit_pb2_grpc, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.processes

GEOMETRY = Geometry(canvas_short_edge=32, canvas_max_pixels=2048, reference_image_short_edge=64)
NOT_SERVED = "workflow: this deployment serves t2va; its DiT replicas do not load {} (the [dit] workflows setting)"


@pytest.fixture(scope="module")
def t2va_stack(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("t2va-only")
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    config = write_config(
        root / "deploy.toml",
        str(tiny_model_dir),
        root / "gateway",
        ports,
        model=GEOMETRY.pipeline_configs(),
        dit={"workflows": ["t2va"]},
        outage_s=QUICK_OUTAGE,
    )
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(root)) as group:
        yield group, ports


def _submit(ports, request) -> gateway_pb2.Job:
    with grpc.insecure_channel(f"127.0.0.1:{ports['gateway']}") as channel:
        return gateway_pb2_grpc.GatewayStub(channel).Submit(request, timeout=30)


def test_a_workflow_the_dit_does_not_load_is_refused_at_submit(t2va_stack, tmp_path):
    group, ports = t2va_stack
    with grpc.insecure_channel(f"127.0.0.1:{ports['dit']}") as channel:
        info = dit_pb2_grpc.DiTStub(channel).Info(common_pb2.InfoRequest())
    assert (list(info.workflows), list(info.partitions)) == ([common_pb2.WORKFLOW_T2VA], ["transformer"])

    client = GatewayClient(f"127.0.0.1:{ports['gateway']}")
    picture = client.upload(image(tmp_path / "a.png", 48, 32, seed=1)).asset_id
    ref2va = gateway_pb2.GenerateRequest(prompt="<Picture 1> waves", height=32, width=64, num_inference_steps=2)
    ref2va.references.add(asset_id=picture)
    fl2va = gateway_pb2.GenerateRequest(prompt="<Picture 1> waves", num_inference_steps=2, first_frame=picture)
    for request, name in ((ref2va, "ref2va"), (fl2va, "fl2va")):
        with pytest.raises(grpc.RpcError) as err:
            _submit(ports, request)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details() == NOT_SERVED.format(name)
    assert not client.stub.ListJobs(gateway_pb2.ListJobsRequest()).jobs, "a refused request writes nothing"

    final = client.generate(
        gateway_pb2.GenerateRequest(prompt="a t2va job", height=32, width=64, num_inference_steps=2)
    )
    assert final.WhichOneof("kind") == "done", final

    # With the DiT down nothing is known about the workflows: the request is accepted and queues, as any other.
    dit = next(item.process for item in group.running if item.name == "dit")
    dit.send_signal(signal.SIGKILL)
    dit.wait(30)
    time.sleep(HEALTH_TTL_S + 0.1)  # past the cached Info answer
    job = _submit(ports, ref2va)
    assert job.state == gateway_pb2.JOB_STATE_QUEUED
    assert client.stub.CancelJob(gateway_pb2.CancelJobRequest(job_id=job.job_id)).state in (
        gateway_pb2.JOB_STATE_CANCELLED,
        gateway_pb2.JOB_STATE_FAILED,
    )
    client.close()
