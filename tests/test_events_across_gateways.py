"""Any gateway on one PostgreSQL store serves any job's live events and cancels (issue 52, item 3; docs/storage.md).

Two real `h3serve serve gateway` processes, A and B, share one database and the tiny stack's services: a Watch on B
of a job running on A sees every event once, in order, and a CancelJob on B cancels A's job mid-denoise (the DiT
holds it there), with one terminal `cancelled`. In-process runners on one store show what processes cannot pin
down: a watcher whose LISTEN connection was cut while the job ended still gets every event once, a cancel reaches
the job's holder by its announcement alone, one whose announcement nobody hears still stops the job at its holder's
next lease renewal (also on SQLite, which announces nothing), a job no gateway holds is cancelled in the store, and
a takeover says who took the job from whom.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import stores
from deployments import write_config
from dit_holding import HELD
from job_runners import QUIET, Gateway, quiet_config, until_in_encoder

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.server import is_answering
from h3serve.gateway.admission.request import RequestLimits, resolve
from h3serve.gateway.jobs.postgres.listen import APPLICATION_NAME
from h3serve.gateway.jobs.runner import CANCELLED_BY_CLIENT, MAX_RESTART_RERUNS
from h3serve.v1 import gateway_pb2

S = gateway_pb2
postgres, backend = stores.postgres, stores.backend  # fixtures
NEVER_RENEWED_S = 3600.0  # a lease whose timer never fires within a test


def _seqs_once_in_order(events: list[gateway_pb2.JobEvent]) -> list[str]:
    """The events' kinds, after checking they are 1..N with one terminal event, the last."""
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    kinds = [e.WhichOneof("kind") for e in events]
    assert sum(kind in ("done", "failed", "cancelled") for kind in kinds) == 1 and kinds[-1] in ("done", "cancelled")
    return kinds


# Two gateway processes.


@pytest.fixture(scope="module")
def gateways(stack, postgres, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """The addresses of gateways A and B on one fresh database, calling the stack's encoder, DiT and VAE."""
    url, root = postgres.new_database(), tmp_path_factory.mktemp("two-gateways")
    (a, address_a), (b, address_b) = _gateway(stack, url, root / "a"), _gateway(stack, url, root / "b")
    with a, b:
        yield address_a, address_b


def _gateway(stack, url: str, root: Path) -> tuple[ServiceGroup, str]:
    root.mkdir()
    ports = {**stack.ports, "gateway": free_port()}
    config = write_config(root / "deploy.toml", str(stack.model_dir), root / "data", ports, store_url=url)
    group = ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=("gateway",), ready=is_answering)
    return group, f"127.0.0.1:{ports['gateway']}"


@pytest.mark.gateway
def test_a_watch_and_a_cancel_on_b_reach_the_job_a_runs(gateways, dit_hold):
    address_a, address_b = gateways
    with dit_hold.armed(), GatewayClient(address_a) as a, GatewayClient(address_b) as b:
        job = a.stub.Submit(S.GenerateRequest(prompt="a fox far away", **HELD, seed=4))
        on_b = []
        for event in b.stub.Watch(S.WatchRequest(job_id=job.job_id)):
            on_b.append(event)
            if dit_hold.holds(event):  # A's job is mid-denoise, held by the DiT
                cancelled = b.stub.CancelJob(S.CancelJobRequest(job_id=job.job_id))
                assert cancelled.state == S.JOB_STATE_CANCELLED, "B answers once the job has ended"
        on_a = list(a.stub.Watch(S.WatchRequest(job_id=job.job_id)))
        ended = b.job(job.job_id)
    kinds = _seqs_once_in_order(on_b)
    assert "denoising" in kinds and kinds[-1] == "cancelled", kinds
    assert on_b[-1].cancelled.reason == CANCELLED_BY_CLIENT
    assert on_a == on_b, "B's live stream is A's stored log"
    dit = [r for r in ended.stage_records if r.stage == "dit"]
    assert [r.error for r in dit] == [CANCELLED_BY_CLIENT], "A's own task stopped its DiT call"


# In-process gateways on one store.


async def _terminate(url: str, application_name: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (application_name,)
        )
        assert await cursor.fetchall() == [(True,)]


@pytest.mark.gateway
def test_a_watch_on_b_gets_every_event_once_across_a_cut_listen_connection(stack, dit_hold, postgres, tmp_path):
    """B's LISTEN connection is cut (pg_terminate_backend) and kept from coming back while A's job runs to its end:
    B's watcher hears nothing of it until B listens again, then reads all it missed from the store."""
    url = postgres.new_database()
    stack_config = load_deploy(stack.config_path).gateway

    async def scenario():
        store_a, store_b = (
            await stores.Backend("postgresql", url).open(),
            await stores.Backend("postgresql", url).open(),
        )
        config_a, config_b = (
            stack_config.model_copy(update={"data_dir": str(tmp_path / n), "blob_dir": ""}) for n in "ab"
        )
        request = resolve(
            S.GenerateRequest(prompt="a fox in the rain", **HELD, seed=5), RequestLimits.from_config(config_a)
        )
        seen: list[gateway_pb2.JobEvent] = []
        held = asyncio.Event()
        async with Gateway(store_a, config_a, "A", 30.0, url) as a, Gateway(store_b, config_b, "B", 30.0, url) as b:
            assert b.listener is not None

            async def watch_on_b():
                async for event in b.hub.watch("j"):
                    seen.append(event)
                    if dit_hold.holds(event):
                        held.set()

            await store_a.submit("j", request, first_event=S.JobEvent(accepted=S.Accepted()))
            with dit_hold.armed():
                a.runner.start("j", request)
                watcher = asyncio.ensure_future(watch_on_b())
                await asyncio.wait_for(held.wait(), 120)  # a safety bound only: B hears A's live events
                b.listener.url = url.replace(postgres.socket_dir, "/nonexistent")  # B cannot listen again
                await _terminate(url, f"{APPLICATION_NAME} B")
                while b.listener.listening.is_set():
                    await asyncio.sleep(0.05)
                heard = len(seen)
            await a.runner._tasks["j"]  # released: A's job runs to its end while B is deaf
            assert len(seen) == heard and not watcher.done(), "B heard nothing while it could not listen"
            b.listener.url = url
            await asyncio.wait_for(watcher, 60)  # a safety bound only: B reads what it missed once it listens
        stored = await store_a.events("j")
        await store_a.close()
        await store_b.close()
        return seen, stored

    seen, stored = asyncio.run(scenario())
    kinds = _seqs_once_in_order(seen)
    assert kinds[-1] == "done" and "denoising" in kinds and seen == stored, kinds


@pytest.mark.gateway
def test_a_cancel_on_b_reaches_a_by_its_announcement_alone(postgres, tmp_path):
    """A's lease outlasts the test (its timer never reads the cancel mark): only the announcement can stop A's job;
    B's watcher hears its events only through B's listener."""
    url = postgres.new_database()

    async def scenario(store_a):
        store_b = await stores.Backend("postgresql", url).open()
        async with (
            Gateway(store_a, quiet_config(tmp_path / "a"), "A", NEVER_RENEWED_S, url) as a,
            Gateway(store_b, quiet_config(tmp_path / "b"), "B", NEVER_RENEWED_S, url) as b,
        ):
            await store_a.submit("j", QUIET, first_event=S.JobEvent(accepted=S.Accepted()))
            a.runner.start("j", QUIET)
            on_b = []
            async with asyncio.timeout(60):  # a safety bound only
                async for event in b.hub.watch("j"):
                    on_b.append(event)
                    if event.HasField("waiting"):  # A's encoder call waits for its stage: it runs
                        assert await b.runner.request_cancel("j")
        await store_b.close()
        return on_b, await store_a.get_job("j")

    on_b, job = stores.Backend("postgresql", url).run(scenario)
    assert _seqs_once_in_order(on_b)[-1] == "cancelled" and job.state == S.JOB_STATE_CANCELLED
    assert [r.error for r in job.stage_records] == [CANCELLED_BY_CLIENT], "A's own task stopped its stage call"


@pytest.mark.gateway
def test_a_cancel_nobody_announces_stops_the_job_at_its_holders_next_renewal(backend, tmp_path):
    """No listener anywhere (SQLite has none): B's cancel is only a mark in the store, which A's lease timer reads."""

    async def scenario(store_a):
        store_b = await backend.open()
        async with (
            Gateway(store_a, quiet_config(tmp_path / "a"), "A") as a,
            Gateway(store_b, quiet_config(tmp_path / "b"), "B") as b,
        ):
            await store_a.submit("j", QUIET, first_event=S.JobEvent(accepted=S.Accepted()))
            a.runner.start("j", QUIET)

            await until_in_encoder(store_b, "j")
            assert await b.runner.request_cancel("j"), "B asked; A holds the job"
            assert "j" in a.runner._tasks, "nothing told A yet"
            await asyncio.wait_for(a.runner._tasks["j"], 60)  # a safety bound only: A's next renewal stops it
            events, job = await store_b.events("j"), await store_b.get_job("j")
        await store_b.close()
        return events, job

    events, job = backend.run(scenario)
    assert _seqs_once_in_order(events)[-1] == "cancelled"
    assert events[-1].cancelled.reason == CANCELLED_BY_CLIENT and job.state == S.JOB_STATE_CANCELLED
    assert [r.error for r in job.stage_records] == [CANCELLED_BY_CLIENT], "A's own task stopped its stage call"


def test_a_job_no_gateway_holds_is_cancelled_in_the_store_and_a_marked_one_at_its_claim(backend, tmp_path):
    async def scenario(store):
        async with Gateway(store, quiet_config(tmp_path), "B") as b:
            await store.submit("free", QUIET, first_event=S.JobEvent(accepted=S.Accepted()))
            assert await b.runner.request_cancel("free"), "nobody holds it: B ends it"
            assert not await b.runner.request_cancel("free"), "ended: nothing more to do"
            assert await store.request_cancel("free") is None and await store.request_cancel("unknown") is None
            await store.submit("held", QUIET, first_event=S.JobEvent(accepted=S.Accepted()))
            assert (await store.claim("A", 30.0)).job_id == "held"
            assert await store.request_cancel("held") == "A", "A holds it: B leaves it to A"
            assert await store.expire("A") == 1  # ... but A is gone before it heard
            await b.runner._claim_all()
            assert "held" not in b.runner._tasks, "B claimed it and ended it instead of running it"
            return {job_id: (await store.get_job(job_id), await store.events(job_id)) for job_id in ("free", "held")}

    for job_id, (job, events) in backend.run(scenario).items():
        assert job.state == S.JOB_STATE_CANCELLED and job.attempts == 0, job_id
        assert _seqs_once_in_order(events) == ["accepted", "cancelled"], job_id


def test_a_takeover_says_which_gateway_took_the_job_from_which(backend, tmp_path):
    async def scenario(store):
        async with Gateway(store, quiet_config(tmp_path / "a"), "A") as a:
            await store.submit("j", QUIET, first_event=S.JobEvent(accepted=S.Accepted()))
            a.runner.start("j", QUIET)

            await until_in_encoder(store, "j")
            await store.expire("A")  # A's lease runs out (A paused, or cut off)
            async with Gateway(store, quiet_config(tmp_path / "b"), "B") as b:
                await b.runner._claim_all()
        return [e.retrying.reason for e in await store.events("j") if e.HasField("retrying")]

    takeover, *_ = backend.run(scenario)  # (then B's shutdown's own)
    assert takeover == (
        "gateway A's lease ran out while this job was in the encoder stage; gateway B took it over; re-run 1 of "
        f"{MAX_RESTART_RERUNS} after a restart; attempt not counted"
    )
