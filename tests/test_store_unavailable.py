"""PostgreSQL going away under a real gateway (issue 52): a submit meanwhile is UNAVAILABLE naming the store, with a
retry time (HTTP: 503 and Retry-After), health says NOT_SERVING and why; the job running through it pauses, and when
the server is back it finishes with every event once and nothing lost.

The module starts a PostgreSQL of its own (the session's is shared by other tests: this one stops it) and the tiny
model's services (the test stack's); the DiT holds the job mid-denoise, so the outage provably lands while it runs."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import stores
from deployments import QUICK_OUTAGE, STACK_MODEL, Stack, write_config
from dit_holding import HELD, HOLD_STEP, DitHold
from grpc_health.v1 import health_pb2, health_pb2_grpc
from job_runners import QUICK_LEASE_S, QUIET, Gateway, quiet_config, until_in_encoder

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.server import is_answering
from h3serve.gateway.api.health import REASON_KEY
from h3serve.gateway.jobs.postgres.pool import RETRY_AFTER_S
from h3serve.gateway.jobs.store import Fenced, Lease, RequestIdConflict, StoreUnavailable
from h3serve.v1 import gateway_pb2, retry_info

pytestmark = pytest.mark.processes

S = gateway_pb2
WAITING_LINE = "waits for the job store"  # the gateway's log line when a job's write meets the outage (runner.py)


@dataclass
class PostgresStack(Stack):
    database: str = ""  # the store_url of its gateway


@pytest.fixture(scope="module")
def server() -> Iterator[stores.PostgresServer]:
    """This module's own PostgreSQL: its tests stop it."""
    with stores.postgres_server() as found:
        yield found


@pytest.fixture(scope="module")
def pg_stack(tmp_path_factory, stack, server) -> Iterator[PostgresStack]:
    """A gateway on this module's PostgreSQL, in front of the test stack's model services (whose DiT holds)."""
    root = tmp_path_factory.mktemp("pg-stack")
    database = server.new_database()
    ports = {**stack.ports, "gateway": free_port(), "http": free_port()}  # the stack's model services
    config_path = write_config(
        root / "deploy.toml",
        str(stack.model_dir),
        root / "gateway",
        ports,
        model=STACK_MODEL,
        outage_s=QUICK_OUTAGE,
        retry_backoff_s=0.1,
        http_port=ports["http"],
        store_url=database,
    )
    group = ServiceGroup(
        load_deploy(config_path), str(config_path), log_dir=str(root), names=("gateway",), ready=is_answering
    )
    with group:
        yield PostgresStack(config_path, group, stack.model_dir, ports, database)


def _named(server: stores.PostgresServer, url: str) -> str:
    """How the gateway names the store at `url` in its messages."""
    database = url.split("?")[0].rsplit("/", 1)[1]
    return f"the job store's PostgreSQL at {server.socket_dir}:{server.port}/{database}"


def test_the_store_names_the_server_it_cannot_reach_and_keeps_its_own_refusals(server):
    from h3serve.gateway.jobs.postgres import PostgresJobStore

    url = server.new_database()
    request, event = S.ResolvedRequest(prompt="a fox"), S.JobEvent(accepted=S.Accepted())

    async def scenario():
        store = await PostgresJobStore.open(url)
        await store.submit("known", request, request_id="once", digest="first")
        with pytest.raises(RequestIdConflict):  # what PostgreSQL itself decides stays as it is
            await store.submit("other", request, request_id="once", digest="second")
        with pytest.raises(Fenced):
            await store.append_event("known", event, lease=Lease("another gateway", 99, 30.0))
        server.stop()
        try:
            for call in (store.ping(), store.append_event("known", event)):  # its health, a write
                with pytest.raises(StoreUnavailable) as away:
                    await call
                assert str(away.value).startswith(f"{_named(server, url)} is unreachable: ")
                assert away.value.retry_after_s == RETRY_AFTER_S
        finally:
            server.start()
        # the first call after the server is back finds a live connection, not one the restart broke
        assert [e.seq for e in await store.events("known")] == [], "the write refused meanwhile left nothing"
        await store.append_event("known", event)
        assert [e.seq for e in await store.events("known")] == [1]
        await store.close()

    asyncio.run(scenario())


def test_a_job_whose_write_waits_past_its_lease_stops_writing_nothing_and_is_claimed_again(server, tmp_path, caplog):
    """Another gateway may hold the job once its lease has run out: the gateway cut off from the store stops the
    job's stage call and writes nothing more of it; with the store back, any gateway's claim takes the job."""
    from h3serve.gateway.jobs.postgres import PostgresJobStore

    url = server.new_database()

    async def scenario():
        store = await PostgresJobStore.open(url)
        try:
            async with Gateway(store, quiet_config(tmp_path), "A") as gateway:
                runner = gateway.runner
                await store.submit("j", QUIET, first_event=S.JobEvent(accepted=S.Accepted()))
                runner.start("j", QUIET)
                task = runner._tasks["j"]
                await until_in_encoder(store, "j")
                server.stop()
                try:
                    runner.cancel("j")  # the cancel's writes meet the outage and wait, past the lease
                    await asyncio.wait_for(task, 60)  # a safety bound only
                finally:
                    server.start()
                assert f"the job store was out of reach past its lease ({QUICK_LEASE_S:g} s)" in caplog.text
                assert runner.queues["encoder"].busy == 0, "its stage call was cancelled"
                job = await store.get_job("j")
                assert (job.state, job.stage_records[0].error) == (S.JOB_STATE_RUNNING, ""), "nothing written after"
                claimed = await store.claim("B", 30.0)
                assert claimed is not None and claimed.job_id == "j"
        finally:
            await store.close()

    asyncio.run(scenario())


def _held(client: GatewayClient, job_id: str, dit_hold: DitHold) -> None:
    """Return once the job is held mid-denoise."""
    for event in client.stub.Watch(S.WatchRequest(job_id=job_id)):
        if dit_hold.holds(event):
            return
    pytest.fail(f"job {job_id} ended before its step {HOLD_STEP}")


def _wait_for_log(path: Path, line: str, limit_s: float = 120) -> None:
    """Until the service's log says `line` (the limit only keeps a broken run from hanging)."""
    deadline = time.monotonic() + limit_s
    while line not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{path.name} never said {line!r}"
        time.sleep(0.2)


def _http(stack: Stack, method: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        stack.http + path, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.load(error)


def _health(client: GatewayClient) -> tuple[int, str]:
    reply, call = health_pb2_grpc.HealthStub(client.channel).Check.with_call(health_pb2.HealthCheckRequest())
    return reply.status, dict(call.trailing_metadata() or ()).get(REASON_KEY, "")


def test_a_postgresql_outage_refuses_submits_pauses_the_running_job_and_loses_nothing(server, pg_stack, dit_hold):
    named = _named(server, pg_stack.database)
    with GatewayClient(pg_stack.address("gateway")) as client:
        assert _health(client) == (health_pb2.HealthCheckResponse.SERVING, "")
        with dit_hold.armed():
            job = client.stub.Submit(S.GenerateRequest(prompt="through an outage", **HELD, seed=7))
            _held(client, job.job_id, dit_hold)
            server.stop()
            try:
                with pytest.raises(grpc.RpcError) as refused:
                    client.stub.Submit(S.GenerateRequest(prompt="while the store is away", **HELD))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert refused.value.details().startswith(f"{named} is unreachable: "), refused.value.details()
                assert retry_info.advised_wait_s(refused.value) == RETRY_AFTER_S

                status, headers, body = _http(pg_stack, "POST", "/v1/videos", {"prompt": "by HTTP, meanwhile"})
                assert (status, headers["retry-after"]) == (503, str(int(RETRY_AFTER_S)))
                assert body["error"]["message"].startswith(named), body

                health, reason = _health(client)
                assert health == health_pb2.HealthCheckResponse.NOT_SERVING and reason.startswith(named), reason
                status, _, body = _http(pg_stack, "GET", "/healthz")
                assert status == 503 and body["serving"] is False and body["reason"].startswith(named), body

                dit_hold.release()  # the job goes on denoising: its next event's write meets the outage
                _wait_for_log(Path(pg_stack.group.log_dir) / "gateway.log", WAITING_LINE)
            finally:
                server.start()

        events = list(client.stub.Watch(S.WatchRequest(job_id=job.job_id)))
        ended = client.job(job.job_id)
        assert _health(client) == (health_pb2.HealthCheckResponse.SERVING, "")
        assert _http(pg_stack, "GET", "/healthz")[::2] == (200, {"serving": True})
        after = client.stub.Submit(
            S.GenerateRequest(prompt="after the outage", height=32, width=64, num_inference_steps=2)
        )
        assert after.state == S.JOB_STATE_QUEUED

    kinds = [event.WhichOneof("kind") for event in events]
    assert [event.seq for event in events] == list(range(1, len(events) + 1)), kinds
    steps = [event.denoising.step for event in events if event.HasField("denoising")]
    assert steps == list(range(1, HELD["num_inference_steps"])), kinds  # each step once, none lost
    assert kinds.count("done") == 1 and kinds[-1] == "done", kinds
    assert (ended.state, ended.attempts, ended.error.message) == (S.JOB_STATE_SUCCEEDED, 1, "")
    assert "retrying" not in kinds, "the outage paused the job; it did not run again"
    assert len([r for r in ended.stage_records if r.stage == "dit"]) == 1
