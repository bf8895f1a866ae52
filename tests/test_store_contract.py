"""The JobStore contract (h3serve/gateway/jobs/store.py) on both backends, for what test_store.py leaves out:
idempotent submits per client, the bounds, stage records, artifacts, ownership scoping, uploads' owners, the
webhook outbox, and jobs' leases (claim, fenced writes, renew, release, expire). Each test runs on a fresh SQLite
file and on a fresh PostgreSQL database (tests/stores.py)."""

import asyncio

import pytest
import stores

from h3serve.gateway.jobs.store import Fenced, Lease, Ownership, QueueFull, RequestIdConflict
from h3serve.gateway.tenants.clients import DEFAULT
from h3serve.v1 import gateway_pb2

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    gateway_pb2.JOB_STATE_QUEUED,
    gateway_pb2.JOB_STATE_RUNNING,
    gateway_pb2.JOB_STATE_SUCCEEDED,
    gateway_pb2.JOB_STATE_FAILED,
    gateway_pb2.JOB_STATE_CANCELLED,
)
REQUEST = gateway_pb2.ResolvedRequest(prompt="a fox", height=32, width=64, num_frames=9)
ACCEPTED = gateway_pb2.JobEvent(accepted=gateway_pb2.Accepted())
DONE = gateway_pb2.JobEvent(done=gateway_pb2.Done())
ALICE, BOB = Ownership("alice", webhook_url="https://a.example/hook"), Ownership("bob")
BOUNDED = Ownership("alice", max_unfinished=2)
postgres, backend = stores.postgres, stores.backend  # fixtures


def _artifact(artifact_id: str) -> gateway_pb2.Artifact:
    return gateway_pb2.Artifact(
        artifact_id=artifact_id, file_name=f"{artifact_id}.mp4", bytes=3, sha256="cd" * 32, media_type="video/mp4"
    )


def test_a_request_id_names_one_job_per_client(backend):
    async def check(store):
        job, created = await store.submit("a1", REQUEST, "rid", "d1", first_event=ACCEPTED, owner=ALICE)
        assert created and (job.state, job.client, job.request_id, job.last_event_seq) == (QUEUED, "alice", "rid", 1)
        again, created = await store.submit("a2", REQUEST, "rid", "d1", first_event=ACCEPTED, owner=ALICE)
        assert not created and again == job, "the same job, and no second event"
        with pytest.raises(RequestIdConflict, match="already names job a1"):
            await store.submit("a3", REQUEST, "rid", "other digest", owner=ALICE)
        bobs, created = await store.submit("b1", REQUEST, "rid", "d2", owner=BOB)
        assert created and bobs.client == "bob"
        assert await store.get_job("a2") is None and await store.get_job("a3") is None

    backend.run(check)


def test_concurrent_submits_of_one_request_id_make_one_job(backend):
    async def check(store):
        tries = await asyncio.gather(*(store.submit(f"j{i}", REQUEST, "rid", "d", owner=BOB) for i in range(8)))
        assert sorted(created for _, created in tries) == [False] * 7 + [True]
        assert len({job.job_id for job, _ in tries}) == 1
        assert await store.count_by_state() == {QUEUED: 1}

    backend.run(check)


def test_the_bounds_refuse_and_write_nothing(backend):
    async def check(store):
        await store.submit("a1", REQUEST, owner=BOUNDED)
        await store.submit("a2", REQUEST, owner=BOUNDED)
        with pytest.raises(QueueFull) as own:
            await store.submit("a3", REQUEST, owner=BOUNDED)
        assert (own.value.depth, own.value.bound, own.value.client) == (2, 2, "alice")
        await store.submit("b1", REQUEST, max_unfinished=3, owner=BOB)
        with pytest.raises(QueueFull) as everyone:
            await store.submit("b2", REQUEST, max_unfinished=3, owner=BOB)
        assert (everyone.value.depth, everyone.value.bound, everyone.value.client) == (3, 3, "")
        assert await store.get_job("a3") is None and await store.get_job("b2") is None
        await store.finish("a1", CANCELLED, gateway_pb2.JobEvent(cancelled=gateway_pb2.Cancelled()))
        assert (await store.submit("a3", REQUEST, owner=BOUNDED))[1], "a finished job frees its place"

    backend.run(check)


def test_stage_records_and_the_unfinished_view(backend):
    async def check(store):
        await store.submit("old", REQUEST)
        await store.submit("new", REQUEST)
        attempt = await store.start_attempt("old")
        first = await store.stage_enqueued("old", attempt, "encoder")
        await store.stage_update(first, started=1.0, finished=2.0, replica="r1", bytes_in=5, bytes_out=7, tries=1)
        second = await store.stage_enqueued("old", attempt, "dit")
        await store.stage_update(second, started=3.0)
        with pytest.raises(ValueError, match="unknown stage record column"):
            await store.stage_update(second, job_id="new")
        records = (await store.get_job("old")).stage_records
        fields = ("stage", "attempt", "started", "finished", "replica", "bytes_in", "bytes_out", "tries")
        assert [tuple(getattr(r, name) for name in fields) for r in records] == [
            ("encoder", 1, 1.0, 2.0, "r1", 5, 7, 1),
            ("dit", 1, 3.0, 0.0, "", 0, 0, 0),
        ]
        found = await store.unfinished()
        assert [(u.job_id, u.state, u.attempts, u.last_stage, u.in_stage) for u in found] == [
            ("old", RUNNING, 1, "dit", True),
            ("new", QUEUED, 0, "", False),
        ]
        retrying = gateway_pb2.JobEvent(retrying=gateway_pb2.Retrying(attempt=1))
        await store.requeue("old", retrying, count_attempt=False, interrupted="gone", count_restart=True)
        old = (await store.unfinished())[0]
        assert (old.state, old.attempts, old.restarts, old.in_stage) == (QUEUED, 0, 1, False)
        assert [r.error for r in (await store.get_job("old")).stage_records] == ["", "gone"], "only the open one"

    backend.run(check)


def test_artifacts_are_kept_listed_oldest_first_and_deleted(backend):
    async def check(store):
        await store.submit("a", REQUEST, owner=ALICE)
        await store.submit("b", REQUEST, owner=BOB)
        for job_id, artifact_id in (("a", "x1"), ("b", "x2"), ("a", "x3")):
            await store.add_artifact(job_id, "video", _artifact(artifact_id), f"artifacts/{artifact_id}")
        oldest = await store.artifacts_oldest_first()
        assert [(s.artifact_id, s.key, s.bytes) for s in oldest] == [
            ("x1", "artifacts/x1", 3),
            ("x2", "artifacts/x2", 3),
            ("x3", "artifacts/x3", 3),
        ]
        assert await store.artifact("x1") == (_artifact("x1"), "artifacts/x1")
        assert await store.artifact("x1", client="alice") == (_artifact("x1"), "artifacts/x1")
        assert await store.artifact("x1", client="bob") is None, "another client's artifact is unknown to it"
        await store.delete_artifact("x1")
        assert await store.artifact("x1") is None
        assert [a.artifact_id for a in (await store.get_job("a")).artifacts] == ["x3"]

    backend.run(check)


def test_reads_are_scoped_to_the_client(backend):
    async def check(store):
        await store.submit("a", REQUEST, owner=ALICE)
        await store.submit("b", REQUEST, owner=BOB)
        await store.start_attempt("b")
        assert (await store.get_job("a", client="alice")).client == "alice"
        assert await store.get_job("a", client="bob") is None
        assert await store.position("a", client="bob") == 0 and await store.position("a", client="alice") > 0
        jobs, cursor = await store.list_jobs([], 10, client="bob")
        assert [job.job_id for job in jobs] == ["b"] and cursor == 0
        assert [job.job_id for job in (await store.list_jobs([QUEUED, RUNNING], 10))[0]] == ["b", "a"]
        assert await store.count_by_state(client="alice") == {QUEUED: 1}
        assert await store.count_by_state() == {QUEUED: 1, RUNNING: 1}

    backend.run(check)


def test_uploads_are_owned_by_each_client_that_sent_them(backend):
    async def check(store):
        assert await store.own_asset("img", "alice")
        assert not await store.own_asset("img", "alice"), "once per client"
        assert await store.own_asset("img", "bob")
        assert await store.owned_assets(["img", "old", "mine"], "alice") == {"img"}
        assert await store.owned_assets(["img", "old"], DEFAULT) == {"old"}, "nobody's upload is the default's"
        assert await store.owned_assets([], "alice") == set()

    backend.run(check)


def test_a_jobs_end_goes_to_the_outbox_with_its_terminal_state(backend):
    async def check(store):
        for job_id in ("ok", "bad", "stopped"):
            await store.submit(job_id, REQUEST, owner=ALICE)
        await store.submit("quiet", REQUEST, owner=BOB)
        ended = await store.finish("ok", SUCCEEDED, DONE)
        await store.finish("bad", FAILED, gateway_pb2.JobEvent(failed=gateway_pb2.Failed(message="no")))
        await store.finish("stopped", CANCELLED, gateway_pb2.JobEvent(cancelled=gateway_pb2.Cancelled()))
        await store.finish("quiet", SUCCEEDED, DONE)
        due = await store.due_webhooks(ended.time + 1, 10)
        assert [(o.job_id, o.client, o.url, o.attempts) for o in due] == [
            ("ok", "alice", ALICE.webhook_url, 0),
            ("bad", "alice", ALICE.webhook_url, 0),
        ]
        assert b'"video.completed"' in due[0].body and b'"video.failed"' in due[1].body
        assert await store.due_webhooks(ended.time - 1, 10) == [], "not due before the job ended"
        assert len(await store.due_webhooks(ended.time + 1, 1)) == 1
        await store.webhook_attempted(due[0].event_id, 503, "busy", False, ended.time + 60)
        await store.webhook_attempted(due[1].event_id, 200, "", True, 0)
        assert await store.due_webhooks(ended.time + 1, 10) == []
        [again] = await store.due_webhooks(ended.time + 61, 10)
        assert (again.event_id, again.attempts) == (due[0].event_id, 1)
        ok, bad = (await store.get_job("ok")).webhook, (await store.get_job("bad")).webhook
        assert (ok.url, ok.event_type, ok.attempts, ok.last_status, ok.last_error) == (
            ALICE.webhook_url,
            "video.completed",
            1,
            503,
            "busy",
        )
        assert (bad.attempts, bad.last_status, bad.delivered_at > 0, bad.next_attempt_at) == (1, 200, True, 0)
        assert not (await store.get_job("stopped")).webhook.event_id, "a cancel sends no webhook"

    backend.run(check)


# Ownership: leases and fenced writes.

HELD_S, RUN_OUT_S = 600.0, -1.0  # a lease that lasts the test, and one that has already run out


def _writes(lease: Lease, record_id: int) -> dict:
    """Every fenced write of one job, under `lease`."""
    retrying = gateway_pb2.JobEvent(retrying=gateway_pb2.Retrying(attempt=1))
    return {
        "append_event": lambda store: store.append_event("j", ACCEPTED, lease=lease),
        "start_attempt": lambda store: store.start_attempt("j", lease=lease),
        "requeue": lambda store: store.requeue("j", retrying, lease=lease),
        "finish": lambda store: store.finish("j", SUCCEEDED, DONE, lease=lease),
        "stage_enqueued": lambda store: store.stage_enqueued("j", 1, "dit", lease=lease),
        "stage_update": lambda store: store.stage_update(record_id, lease=lease, started=9.0),
        "set_stage_seconds": lambda store: store.set_stage_seconds("j", "dit", 9.0, lease=lease),
        "add_artifact": lambda store: store.add_artifact("j", "video", _artifact("late"), "/late", lease=lease),
        "renew": lambda store: store.renew("j", lease),
        "release": lambda store: store.release("j", lease),
    }


def test_a_claim_takes_the_oldest_job_whose_lease_ran_out_and_raises_its_fence(backend):
    async def check(store):
        for job_id in ("first", "second", "third"):
            await store.submit(job_id, REQUEST)
        claimed = await store.claim("A", HELD_S)
        assert (claimed.job_id, claimed.state, claimed.fence) == ("first", QUEUED, 1)
        assert (await store.claim("B", HELD_S, job_id="first")) is None, "held: not claimable, even by name"
        assert (await store.claim("B", HELD_S, job_id="third")).job_id == "third"
        assert (await store.claim("B", RUN_OUT_S)).job_id == "second"
        taken = await store.claim("C", HELD_S)
        assert (taken.job_id, taken.fence) == ("second", 2), "a lease that ran out is taken over, fence raised"
        assert await store.claim("C", HELD_S) is None
        await store.finish("third", CANCELLED, gateway_pb2.JobEvent(cancelled=gateway_pb2.Cancelled()))
        assert [u.job_id for u in await store.unfinished()] == ["first", "second"]

    backend.run(check)


def test_concurrent_claims_take_each_job_once(backend):
    async def check(store):
        for i in range(5):
            await store.submit(f"j{i}", REQUEST)
        claims = await asyncio.gather(*(store.claim(f"g{i}", HELD_S) for i in range(8)))
        taken = sorted(claimed.job_id for claimed in claims if claimed is not None)
        assert taken == [f"j{i}" for i in range(5)]

    backend.run(check)


def test_a_taken_over_lease_writes_nothing_and_the_new_one_writes(backend):
    async def check(store):
        await store.submit("j", REQUEST, first_event=ACCEPTED)
        old = Lease("A", (await store.claim("A", RUN_OUT_S)).fence, RUN_OUT_S)  # its renewals run out at once
        assert await store.start_attempt("j", lease=old) == 1
        record_id = await store.stage_enqueued("j", 1, "encoder", lease=old)
        new = Lease("B", (await store.claim("B", HELD_S)).fence, HELD_S)
        assert new.fence == old.fence + 1
        before = await store.get_job("j")
        for name, write in _writes(old, record_id).items():
            with pytest.raises(Fenced, match="is no longer the job's"):
                await write(store)
            assert await store.get_job("j") == before, f"{name} under a stale fence wrote"
        assert (await store.append_event("j", ACCEPTED, lease=new)).seq == 2
        assert (await store.finish("j", SUCCEEDED, DONE, lease=new)).seq == 3
        with pytest.raises(Fenced):
            await store.append_event("j", ACCEPTED, lease=new)  # the job ended: nothing more of it
        assert [e.seq for e in await store.events("j")] == [1, 2, 3]

    backend.run(check)


def test_a_fenced_write_renews_the_lease_and_release_and_expire_end_it(backend):
    async def check(store):
        await store.submit("j", REQUEST)
        lease = Lease("A", (await store.claim("A", RUN_OUT_S)).fence, HELD_S)
        await store.renew("j", lease)
        assert await store.claim("B", HELD_S) is None, "renewed: held again"
        await store.release("j", lease)
        again = await store.claim("A", HELD_S)
        assert again.fence == lease.fence + 1, "released: claimable at once"
        assert await store.expire("B") == 0
        assert await store.expire("A") == 1, "a gateway's start ends its earlier run's leases"
        assert (await store.claim("A", HELD_S)).fence == again.fence + 1

    backend.run(check)
