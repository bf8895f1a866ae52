"""Malformed requests thrown at a real gateway process: each gets a clear status, the server keeps serving.

The gateway's stages point at ports where nothing listens, so a request that happens to be valid is
admitted and its job fails UNAVAILABLE without any model work.
"""

from __future__ import annotations

import grpc
import pytest
from deployments import QUICK_OUTAGE, write_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h3serve.cli.launcher import ServiceGroup, is_answering
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = [pytest.mark.gateway, pytest.mark.processes]
S = gateway_pb2
CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))

int32 = st.integers(-(2**31), 2**31 - 1)
small_or_any = st.one_of(st.sampled_from([0, 32, 64, 124, 141, 345, 768, 1344]), int32)


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    root = tmp_path_factory.mktemp("property")
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    config = write_config(
        root / "deploy.toml", "", root / "gateway", ports, outage_s=QUICK_OUTAGE, max_unfinished_jobs=5000
    )
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=("gateway",), ready=is_answering):
        with grpc.insecure_channel(f"127.0.0.1:{ports['gateway']}") as channel:
            yield gateway_pb2_grpc.GatewayStub(channel), channel


def assert_clear_status(call) -> None:
    """The call succeeds, or fails with a status from CLEAR and a message that names the problem."""
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() in CLEAR, (err.code(), err.details())
        assert err.details() and len(err.details()) < 4000


@SETTINGS
@given(
    prompt=st.one_of(st.text(max_size=40), st.just(" \t\n"), st.just("x" * 8193)),
    height=small_or_any,
    width=small_or_any,
    num_frames=small_or_any,
    seconds=st.floats(allow_nan=True, allow_infinity=True),
    steps=small_or_any,
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    workflow=st.integers(-5, 2**31 - 1),
    request_id=st.one_of(st.just(""), st.text(max_size=200)),
    include_raw=st.booleans(),
)
def test_malformed_submits_get_a_clear_status(
    stub, prompt, height, width, num_frames, seconds, steps, seed, workflow, request_id, include_raw
):
    request = S.GenerateRequest(
        prompt=prompt,
        height=height,
        width=width,
        num_frames=num_frames,
        seconds=seconds,
        num_inference_steps=steps,
        workflow=workflow,
        request_id=request_id,
        include_raw=include_raw,
    )
    if seed is not None:
        request.seed = seed
    assert_clear_status(lambda: stub[0].Submit(request, timeout=30))


@SETTINGS
@given(
    job_id=st.text(max_size=300),
    after_seq=st.integers(-(2**63), 2**63 - 1),
    page_size=int32,
    page_token=st.text(max_size=40),
    states=st.lists(st.integers(-3, 2**31 - 1), max_size=4),
)
def test_malformed_lookups_get_a_clear_status(stub, job_id, after_seq, page_size, page_token, states):
    api = stub[0]
    assert_clear_status(lambda: api.GetJob(S.GetJobRequest(job_id=job_id), timeout=30))
    assert_clear_status(lambda: api.CancelJob(S.CancelJobRequest(job_id=job_id), timeout=30))
    assert_clear_status(lambda: list(api.Watch(S.WatchRequest(job_id=job_id, after_seq=after_seq), timeout=30)))
    assert_clear_status(lambda: list(api.DownloadArtifact(S.DownloadArtifactRequest(artifact_id=job_id), timeout=30)))
    assert_clear_status(
        lambda: api.ListJobs(S.ListJobsRequest(page_size=page_size, page_token=page_token, states=states), timeout=30)
    )


def test_an_oversized_request_is_refused_and_the_server_keeps_serving(stub):
    api, channel = stub
    with pytest.raises(grpc.RpcError) as err:
        api.Submit(S.GenerateRequest(prompt="x" * (5 << 20)), timeout=30)
    # received whole (the door's limit fits the largest legal request), then refused by the field's own limit
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt: at most" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        api.GetJob(S.GetJobRequest(job_id="still-here"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING, "its stages are down, and it says so"
