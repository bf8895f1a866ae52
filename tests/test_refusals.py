"""Refusals that say whether and when to try again (issue 51): on a real `h3serve serve gateway` (its stages never
started, so an accepted job stays unfinished). A 9 MB prompt arrives whole and is INVALID_ARGUMENT naming the
prompt's limit, never retried by the client; a full queue is RESOURCE_EXHAUSTED with google.rpc.RetryInfo on gRPC and
429 with Retry-After on HTTP, and the client waits the advised time and then succeeds."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from conftest import free_port, write_config

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient, retry
from h3serve.common.config import MAX_PROMPT_CHARS, load_deploy
from h3serve.common.server import is_answering
from h3serve.gateway.jobs.drain import DEFAULT_WAIT_S
from h3serve.v1 import gateway_pb2, retry_info

pytestmark = pytest.mark.processes

S = gateway_pb2


class Gateway:
    def __init__(self, address: str, http: str):
        self.address, self.http = address, http


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway alone, bounded at one unfinished job, with its HTTP door."""
    tmp: Path = tmp_path_factory.mktemp("refusals")
    port, http = free_port(), free_port()
    ports = dict(encoder=free_port(), dit=free_port(), vae=free_port(), gateway=port)
    config = write_config(tmp / "deploy.toml", "", tmp / "gateway", ports, max_unfinished_jobs=1, http_port=http)
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp), names=("gateway",), ready=is_answering):
        yield Gateway(f"127.0.0.1:{port}", f"http://127.0.0.1:{http}")


@pytest.fixture
def sleeps(monkeypatch):
    """Every wait of the client's retry policy, recorded (and still waited)."""
    waited: list[float] = []

    def sleep(seconds: float) -> None:
        waited.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(retry, "time", SimpleNamespace(sleep=sleep))
    return waited


def test_a_9_mb_prompt_is_invalid_argument_naming_the_limit_and_never_retried(gateway, sleeps):
    prompt = "a fox " * ((9 << 20) // 6)
    with GatewayClient(gateway.address) as client, pytest.raises(grpc.RpcError) as refused:
        client.submit(S.GenerateRequest(prompt=prompt))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == f"prompt: at most {MAX_PROMPT_CHARS} characters, got {len(prompt)}"
    assert sleeps == [], "a refusal by size is never retried"


def _post(url: str, body: dict) -> urllib.error.HTTPError:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    return refused.value


def test_a_full_queue_advises_when_to_come_back_and_the_client_waits_it_out(gateway, sleeps):
    with GatewayClient(gateway.address) as client:
        first = client.submit(S.GenerateRequest(prompt="the one job the queue holds"))

        with pytest.raises(grpc.RpcError) as refused:  # the stub alone: no retry
            client.stub.Submit(S.GenerateRequest(prompt="a second job"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert retry_info.advised_wait_s(refused.value) == DEFAULT_WAIT_S, "no job ended yet: the default wait"
        assert refused.value.details().endswith(f"; retry in {DEFAULT_WAIT_S} s")

        http = _post(f"{gateway.http}/v1/videos", {"prompt": "a second job"})
        assert http.code == 429 and http.headers["retry-after"] == str(DEFAULT_WAIT_S)

        def cancel_the_first_while_waiting(seconds: float) -> None:
            sleeps.append(seconds)
            if len(sleeps) == 1:
                client.cancel(first.job_id)  # the place frees while the client waits
            time.sleep(seconds)

        retry.time = SimpleNamespace(sleep=cancel_the_first_while_waiting)  # the fixture puts the module back
        second = client.submit(S.GenerateRequest(prompt="a second job"))
    assert sleeps == [DEFAULT_WAIT_S], "waited the advised time (longer than the back-off's first 0.25 s), once"
    assert second.state in (S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING) and second.job_id != first.job_id
