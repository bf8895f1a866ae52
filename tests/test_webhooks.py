"""Webhooks (issue 51, item 9): a job's end POSTed as OpenAI's video.completed / video.failed event, signed so that the
openai SDK's own `webhooks.unwrap` verifies it, from an outbox written with the job's terminal state, retried with
back-off until its endpoint answers 2xx, across a gateway SIGKILL, each attempt's outcome on the job.

A receiver in the test (a small HTTP server that fails the first deliveries of every event); the store and the sender
in-process for the rules, then a real gateway process in front of the test stack's model services, killed between
deliveries."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import openai
import pytest
from deployments import STACK_MODEL, write_config
from up_process import wait_until
from webhook_receiver import REFUSED, Receiver

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import GatewayConfig, load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.server import is_answering
from h3serve.gateway.jobs.sqlite import SqliteJobStore
from h3serve.gateway.jobs.store import Ownership
from h3serve.gateway.tenants.clients import entry, new_token
from h3serve.gateway.tenants.registry import Tenants
from h3serve.gateway.webhooks.delivery import WebhookSender
from h3serve.gateway.webhooks.signing import headers, new_secret
from h3serve.v1 import gateway_pb2 as S

SDK = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")  # verifies only: never connects


@pytest.fixture
def receiver():
    found = Receiver(fail_first=2)
    yield found
    found.close()


def test_the_signature_is_the_one_the_openai_sdk_verifies():
    secret, body = new_secret(), b'{"id":"evt_1","object":"event","created_at":1,"type":"video.completed"}'
    signed = headers(secret, "evt_1", int(time.time()), body)
    SDK.webhooks.verify_signature(body, signed, secret=secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        SDK.webhooks.verify_signature(body.replace(b"completed", b"failed"), signed, secret=secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        SDK.webhooks.verify_signature(body, signed, secret=new_secret())


def test_each_end_enters_the_outbox_with_its_state_and_is_sent_until_answered_or_given_up(tmp_path, receiver):
    """Succeeded and failed jobs with an endpoint each get their event; a cancelled one and one without an endpoint
    none. The receiver refuses the first two attempts of each event; an endpoint that always refuses is given up
    after webhook_max_attempts, with the reason on the job."""
    secret = new_secret()
    (tmp_path / "clients.toml").write_text(entry("alice", new_token(), webhook_secret=secret))
    config = GatewayConfig(clients_file=str(tmp_path / "clients.toml"), webhook_backoff_s=0.05, webhook_max_attempts=3)
    ends = {
        "completed": (S.JOB_STATE_SUCCEEDED, S.JobEvent(done=S.Done()), "/hooks"),
        "failed": (S.JOB_STATE_FAILED, S.JobEvent(failed=S.Failed(code_name="UNAVAILABLE")), "/hooks"),
        "cancelled": (S.JOB_STATE_CANCELLED, S.JobEvent(cancelled=S.Cancelled()), "/hooks"),
        "no-endpoint": (S.JOB_STATE_SUCCEEDED, S.JobEvent(done=S.Done()), ""),
        "refused": (S.JOB_STATE_SUCCEEDED, S.JobEvent(done=S.Done()), "/never"),
    }

    async def scenario():
        store = SqliteJobStore(str(tmp_path / "jobs.sqlite"))
        for job_id, (state, event, path) in ends.items():
            url = receiver.url + path if path else ""
            await store.submit(job_id, S.ResolvedRequest(prompt=job_id), owner=Ownership("alice", webhook_url=url))
            await store.finish(job_id, state, event)
        sender = asyncio.ensure_future(WebhookSender(config, store, Tenants(config)).run())
        try:  # until nothing more is due: each delivered or given up
            while any([(await store.get_job(i)).webhook.next_attempt_at for i in ("completed", "failed", "refused")]):
                await asyncio.sleep(0.05)
        finally:
            sender.cancel()
        jobs = {job_id: await store.get_job(job_id) for job_id in ends}
        await store.close()
        return jobs

    jobs = asyncio.run(scenario())
    assert [j.webhook.event_type for j in jobs.values()] == [
        "video.completed",
        "video.failed",
        "",
        "",
        "video.completed",
    ]
    assert not jobs["no-endpoint"].HasField("webhook") and jobs["cancelled"].webhook.url == receiver.url + "/hooks"
    for job_id in ("completed", "failed"):
        delivery = jobs[job_id].webhook
        sent = receiver.attempts(delivery.event_id)
        assert [r[3] for r in sent] == [REFUSED, REFUSED, 200] and delivery.attempts == 3
        assert (delivery.last_status, delivery.last_error, delivery.next_attempt_at) == (200, "", 0)
        assert delivery.delivered_at > 0 and len({r[2] for r in sent}) == 1, "every attempt sends the same event"
        event = SDK.webhooks.unwrap(sent[-1][2], sent[-1][1], secret=secret)
        assert (event.id, event.type, event.data.id, event.object) == (
            delivery.event_id,
            delivery.event_type,
            job_id,
            "event",
        )
    given_up = jobs["refused"].webhook
    assert (given_up.attempts, given_up.last_status, given_up.delivered_at, given_up.next_attempt_at) == (
        3,
        REFUSED,
        0,
        0,
    )
    assert given_up.last_error == f"the endpoint answered HTTP {REFUSED}"
    assert len(receiver.attempts(given_up.event_id)) == 3


@pytest.mark.gateway
def test_every_event_arrives_verified_across_a_gateway_sigkill_between_its_deliveries(stack, tmp_path, receiver):
    """Two jobs on the test stack: alice's endpoint from the clients file (over gRPC), and another named by the
    request (over the HTTP door, with the openai SDK). Each event's first delivery is refused; the gateway is then
    SIGKILLed; the restarted one sends the rest from its store."""
    secret, tokens = new_secret(), {"alice": new_token(), "bob": new_token()}
    clients = tmp_path / "clients.toml"
    clients.write_text(
        entry("alice", tokens["alice"], webhook_url=receiver.url + "/client", webhook_secret=secret)
        + entry("bob", tokens["bob"])
    )
    ports = {**stack.ports, "gateway": free_port(), "http": free_port()}  # the stack's model services
    config = write_config(
        tmp_path / "deploy.toml",
        str(stack.model_dir),
        tmp_path / "gateway",
        ports,
        model=STACK_MODEL,
        clients_file=str(clients),
        http_port=ports["http"],
        # 12 s between attempts: the kill, as soon as both first attempts are recorded, comes before any second one
        webhook_backoff_s=12.0,
        webhook_max_backoff_s=12.0,
    )
    small = dict(height=32, width=64, num_inference_steps=2)
    group = ServiceGroup(
        load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",), ready=is_answering
    )
    with group, GatewayClient(f"127.0.0.1:{ports['gateway']}", token=tokens["alice"]) as alice:
        by_grpc = alice.submit(S.GenerateRequest(prompt="a webhook over grpc", seed=1, **small)).job_id
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key=tokens["alice"], max_retries=0)
        by_http = sdk.videos.create(
            prompt="a webhook over http",
            size="64x32",
            extra_body={"steps": 2, "webhook_url": receiver.url + "/request"},
        ).id
        jobs = (by_grpc, by_http)
        for job_id in jobs:
            assert list(alice.events(job_id))[-1].HasField("done")
        # each event refused once, and that attempt recorded: the kill falls between deliveries
        wait_until(lambda: all(alice.job(j).webhook.attempts >= 1 for j in jobs), 60, "a first attempt of each")
        first = {j: alice.job(j).webhook for j in jobs}
        assert {(d.last_status, d.last_error) for d in first.values()} == {
            (REFUSED, f"the endpoint answered HTTP {REFUSED}")
        }
        group.restart("gateway", signal.SIGKILL)

        wait_until(lambda: all(receiver.delivered(first[j].event_id) for j in jobs), 120, "every event delivered")
        wait_until(lambda: all(alice.job(j).webhook.delivered_at for j in jobs), 30, "the deliveries recorded")
        for job_id, path in ((by_grpc, "/client"), (by_http, "/request")):
            delivery = alice.job(job_id).webhook
            sent = receiver.attempts(delivery.event_id)
            assert [(r[0], r[3]) for r in sent] == [(path, REFUSED), (path, REFUSED), (path, 200)]
            assert (delivery.url, delivery.attempts, delivery.last_status, delivery.next_attempt_at) == (
                receiver.url + path,
                3,
                200,
                0,
            )
            event = SDK.webhooks.unwrap(sent[-1][2], sent[-1][1], secret=secret)
            assert (event.id, event.type, event.data.id) == (delivery.event_id, "video.completed", job_id)
            assert json.loads(sent[0][2]) == json.loads(sent[-1][2]), "a retry sends the same event"
        video = sdk.videos.retrieve(by_http).model_dump()["h3serve"]
        assert (video["client"], video["webhook"]["attempts"], video["webhook"]["last_status"]) == ("alice", 3, 200)

        # the finished videos are alice's alone: bob can neither see nor download them
        artifact = alice.job(by_grpc).artifacts[0].artifact_id
        with GatewayClient(f"127.0.0.1:{ports['gateway']}", token=tokens["bob"]) as bob:
            with pytest.raises(grpc.RpcError) as refused:
                list(bob.stub.DownloadArtifact(S.DownloadArtifactRequest(artifact_id=artifact)))
            assert refused.value.code().name == "NOT_FOUND"
            assert alice.download(artifact, tmp_path).stat().st_size == alice.job(by_grpc).artifacts[0].bytes
