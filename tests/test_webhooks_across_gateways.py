"""Webhooks with several gateways on one PostgreSQL store (issue 52): each event is delivered once, whichever gateway's
sender reads it, because reading what is due takes it; an event whose sender died mid-send is due again once its
hold has passed (at least once).

Two senders, each on its own store (its own pool of connections, as two gateways have), against a real HTTP receiver
on loopback that answers slowly: both read the outbox while the other's deliveries are still in flight."""

from __future__ import annotations

import asyncio
import time

import pytest
import stores
from webhook_receiver import Receiver

from h3serve.common.config import GatewayConfig
from h3serve.gateway.jobs.store import Ownership
from h3serve.gateway.tenants.clients import entry, new_token
from h3serve.gateway.tenants.registry import Tenants
from h3serve.gateway.webhooks.delivery import SENDERS, WebhookSender
from h3serve.gateway.webhooks.signing import new_secret
from h3serve.v1 import gateway_pb2 as S

postgres = stores.postgres  # fixture
EVENTS = 3 * SENDERS  # more than one read of the outbox takes: the senders' reads interleave


@pytest.fixture
def receiver():
    found = Receiver(fail_first=0, delay_s=0.2)
    yield found
    found.close()


async def _ended_jobs(store, count: int, url: str) -> list[str]:
    """`count` succeeded jobs of alice's, each with its event due in the outbox."""
    job_ids = [f"job-{i}" for i in range(count)]
    for job_id in job_ids:
        await store.submit(job_id, S.ResolvedRequest(prompt=job_id), owner=Ownership("alice", webhook_url=url))
        await store.finish(job_id, S.JOB_STATE_SUCCEEDED, S.JobEvent(done=S.Done()))
    return job_ids


def test_two_gateways_senders_deliver_each_event_once(postgres, tmp_path, receiver):
    (tmp_path / "clients.toml").write_text(entry("alice", new_token(), webhook_secret=new_secret()))
    config = GatewayConfig(clients_file=str(tmp_path / "clients.toml"))
    backend = stores.Backend("postgresql", postgres.new_database())

    async def scenario():
        first, second = await backend.open(), await backend.open()
        job_ids = await _ended_jobs(first, EVENTS, receiver.url + "/hooks")
        senders = [
            asyncio.ensure_future(WebhookSender(config, store, Tenants(config)).run()) for store in (first, second)
        ]
        try:  # until every event is recorded delivered
            while not all([(await first.get_job(job_id)).webhook.delivered_at for job_id in job_ids]):
                await asyncio.sleep(0.1)
        finally:
            for sender in senders:
                sender.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
        jobs = [await first.get_job(job_id) for job_id in job_ids]
        await first.close()
        await second.close()
        return jobs

    jobs = asyncio.run(scenario())
    delivered = [record[1]["webhook-id"] for record in receiver.received]
    assert sorted(delivered) == sorted(job.webhook.event_id for job in jobs), "each event once, none missing"
    assert {(job.webhook.attempts, job.webhook.last_status) for job in jobs} == {(1, 200)}


def test_an_event_taken_by_a_sender_that_died_is_due_again_after_its_hold(postgres):
    backend = stores.Backend("postgresql", postgres.new_database())

    async def scenario(store):
        await _ended_jobs(store, 2, "http://127.0.0.1:9/hooks")
        now = time.time() + 1
        taken = await store.due_webhooks(now, 1, hold_s=60)
        assert len(taken) == 1
        [other] = await store.due_webhooks(now, 10, hold_s=60)
        assert other.event_id != taken[0].event_id, "a taken event is left to its sender"
        assert await store.due_webhooks(now + 59, 10) == []
        # its sender never recorded an outcome (it died): after the hold the event is due again, for anyone
        again = await store.due_webhooks(now + 61, 10)
        assert sorted(item.event_id for item in again) == sorted([taken[0].event_id, other.event_id])

    backend.run(scenario)
