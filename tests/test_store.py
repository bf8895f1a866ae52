"""The gateway's durable job store and artifact files: the JobStore contract on both backends (`backend`: a real
SQLite file, a real PostgreSQL database), what only SQLite has (WAL, its thread, an old file's upgrade), and the
restart policy the job runner applies with the store."""

import asyncio
import hashlib
import os
import sqlite3
import threading
from contextlib import closing

import grpc
import pytest
import stores
from stores import with_store

from h3serve.common.config import GatewayConfig
from h3serve.common.errors import MAX_ERROR_CHARS
from h3serve.gateway.blobs import DirectoryBlobs
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.jobs.sqlite import SqliteJobStore
from h3serve.gateway.jobs.sqlite.database import Database
from h3serve.gateway.jobs.store import JobStore
from h3serve.v1 import common_pb2, gateway_pb2

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    gateway_pb2.JOB_STATE_QUEUED,
    gateway_pb2.JOB_STATE_RUNNING,
    gateway_pb2.JOB_STATE_SUCCEEDED,
    gateway_pb2.JOB_STATE_FAILED,
    gateway_pb2.JOB_STATE_CANCELLED,
)

PARAMS = common_pb2.GenerationParams(num_inference_steps=50, seed=2**62 + 5, include_raw=True)
REQUEST = gateway_pb2.ResolvedRequest(
    prompt="a fox", height=768, width=1344, num_frames=124, params=PARAMS, workflow=common_pb2.WORKFLOW_T2VA
)
CANCEL = gateway_pb2.JobEvent(cancelled=gateway_pb2.Cancelled(reason="x"))
postgres, backend = stores.postgres, stores.backend  # fixtures: the contract runs on both backends


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "nested" / "jobs.sqlite")


def _artifact(job_id, kind, size=10):
    extension = ".mp4" if kind == "video" else ".npz"
    return gateway_pb2.Artifact(
        artifact_id=f"{job_id}-{kind}",
        file_name=f"h3-{job_id}{extension}",
        bytes=size,
        sha256="ab" * 32,
        media_type="video/mp4" if kind == "video" else "application/x-npz",
    )


def test_each_store_implements_every_method_of_the_protocol():
    from h3serve.gateway.jobs.postgres import PostgresJobStore

    declared = {name for name, value in vars(JobStore).items() if asyncio.iscoroutinefunction(value)}
    for implementation in (SqliteJobStore, PostgresJobStore):
        assert all(asyncio.iscoroutinefunction(vars(implementation).get(name)) for name in declared)
    answered_by_the_store = {"ping"}  # SQLite's store answers it itself: a local file has no server to reach
    assert all(callable(getattr(Database, name)) for name in declared - answered_by_the_store)


def test_journal_mode_is_wal(db_path):
    async def check(store):
        with closing(sqlite3.connect(db_path)) as other:
            assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)

    with_store(db_path, check)


def test_queries_run_off_the_event_loop_thread(db_path):
    async def check(store):
        await store.submit("j", REQUEST)
        seen = await store._on_thread(store._db._rows, "SELECT 1")  # any query: which thread ran it
        thread = await asyncio.wrap_future(store._thread.submit(threading.current_thread))
        assert seen == [(1,)] and thread is not threading.current_thread()

    with_store(db_path, check)


def test_round_trip_survives_reopen(backend):
    async def write():
        store = await backend.open()
        created, is_new = await store.submit("j1", REQUEST)
        assert is_new and created.state == QUEUED and created.request == REQUEST
        await store.append_event("j1", gateway_pb2.JobEvent(accepted=gateway_pb2.Accepted(request=REQUEST)))
        assert await store.start_attempt("j1") == 1
        await store.append_event("j1", gateway_pb2.JobEvent(denoising=gateway_pb2.Denoising(step=1, total=49)))
        await store.set_stage_seconds("j1", "encode", 1.5)
        await store.set_stage_seconds("j1", "denoise", 30.0)
        await store.set_stage_seconds("j1", "encode", 2.5)  # rewritten in place, keeps its position
        await store.add_artifact("j1", "raw", _artifact("j1", "raw"), "/data/h3-j1.npz")
        await store.add_artifact("j1", "video", _artifact("j1", "video"), "/data/h3-j1.mp4")
        done = gateway_pb2.JobEvent(done=gateway_pb2.Done(video=_artifact("j1", "video")))
        assert (await store.finish("j1", SUCCEEDED, done)).seq == 3
        await store.close()
        return created

    async def read(created):
        reopened = await backend.open()
        job = await reopened.get_job("j1")
        assert job.job_id == "j1" and job.state == SUCCEEDED and job.request == REQUEST
        assert job.created == created.created and job.updated >= job.created
        assert [a.artifact_id for a in job.artifacts] == ["j1-video", "j1-raw"]
        assert job.artifacts[0] == _artifact("j1", "video")
        assert [(s.stage, s.seconds) for s in job.stages] == [("encode", 2.5), ("denoise", 30.0)]
        assert not job.HasField("error")
        assert job.last_event_seq == 3
        events = await reopened.events("j1")
        assert [e.WhichOneof("kind") for e in events] == ["accepted", "denoising", "done"]
        assert events[0].accepted.request == REQUEST and events[1].denoising.step == 1
        assert await reopened.artifact("j1-raw") == (_artifact("j1", "raw"), "/data/h3-j1.npz")
        assert await reopened.artifact("nope") is None
        assert await reopened.get_job("nope") is None
        await reopened.close()

    run(read(run(write())))


def test_a_request_stored_before_params_reads_with_them(backend):
    """A job written by a gateway from before GenerationParams still runs: its options come from the old fields."""
    old = gateway_pb2.ResolvedRequest(
        prompt="a fox", height=32, width=64, num_frames=124, num_inference_steps=8, seed=7, include_raw=True
    )

    async def check(store):
        await store.submit("old", old)
        job = await store.get_job("old")
        assert job.request.params == common_pb2.GenerationParams(num_inference_steps=8, seed=7, include_raw=True)
        assert [u.request.params.seed for u in await store.unfinished()] == [7]

    backend.run(check)


def test_seq_is_one_to_n_and_ordered(backend):
    async def check(store):
        await store.submit("j", REQUEST)
        stored = [
            await store.append_event("j", gateway_pb2.JobEvent(decoding=gateway_pb2.Decoding(chunk=i, total=5)))
            for i in range(1, 6)
        ]
        assert [e.seq for e in stored] == [1, 2, 3, 4, 5]
        assert all(e.job_id == "j" and e.time > 0 for e in stored)
        assert [e.time for e in stored] == sorted(e.time for e in stored)
        assert await store.events("j") == stored
        assert await store.events("j", after_seq=3) == stored[3:]
        assert await store.events("other") == []
        with pytest.raises(KeyError):
            await store.append_event("ghost", CANCEL)

    backend.run(check)


def test_concurrent_appends_get_unique_contiguous_seqs(backend):
    async def check(store):
        await store.submit("j", REQUEST)
        tasks, per_task = 8, 25

        async def append(t):
            return [
                (
                    await store.append_event("j", gateway_pb2.JobEvent(decoding=gateway_pb2.Decoding(chunk=i, total=t)))
                ).seq
                for i in range(per_task)
            ]

        returned = await asyncio.gather(*(append(t) for t in range(tasks)))
        total = tasks * per_task
        assert sorted(seq for seqs in returned for seq in seqs) == list(range(1, total + 1))
        assert all(seqs == sorted(seqs) for seqs in returned)
        assert [e.seq for e in await store.events("j")] == list(range(1, total + 1))
        assert (await store.get_job("j")).last_event_seq == total

    backend.run(check)


def test_a_watcher_gets_the_event_whose_emit_was_cancelled_while_the_store_wrote_it(backend):
    """CancelJob cancels a running job's task, maybe while its step event is being written: the event is stored
    (the write runs on in its thread) but never published. A live watcher reads it from the store when the next
    event shows the gap, so its stream is what the store holds (and Job.progress, folded from the store, is what
    the stream's last event says)."""
    from h3serve.gateway.jobs.events import EventHub

    async def check(store):
        hub = EventHub(store)
        await store.submit("j", REQUEST, first_event=gateway_pb2.JobEvent(accepted=gateway_pb2.Accepted()))
        watcher = hub.watch("j")
        assert (await anext(watcher)).HasField("accepted")
        next_event = asyncio.ensure_future(anext(watcher))
        # what a cancelled emit leaves: the store's write, which runs on in its thread, and no publish
        await store.append_event("j", gateway_pb2.JobEvent(denoising=gateway_pb2.Denoising(step=1)))
        await asyncio.sleep(0.05)
        assert not next_event.done(), "nothing was published"
        await hub.emit("j", cancelled=gateway_pb2.Cancelled(reason="by the test"))
        streamed = [await next_event] + [event async for event in watcher]
        assert [e.WhichOneof("kind") for e in streamed] == ["denoising", "cancelled"]
        assert streamed == (await store.events("j"))[1:]

    backend.run(check)


def test_terminal_state_and_its_event_are_written_together_and_are_final(backend):
    async def check(store):
        await store.submit("j", REQUEST)
        assert await store.start_attempt("j") == 1
        cancelled = await store.finish("j", CANCELLED, CANCEL)
        assert cancelled.seq == 1 and (await store.get_job("j")).state == CANCELLED
        late = gateway_pb2.JobEvent(failed=gateway_pb2.Failed(code_name="INTERNAL", message="late"))
        assert await store.finish("j", FAILED, late) is None, "a final job never changes again"
        assert await store.start_attempt("j") == 0
        assert await store.requeue("j", CANCEL) is None
        job = await store.get_job("j")
        assert job.state == CANCELLED and not job.HasField("error") and job.last_event_seq == 1
        assert await store.finish("ghost", FAILED, late) is None

    backend.run(check)


def test_requeue_counts_the_attempt_or_takes_it_back(backend):
    async def check(store):
        await store.submit("j", REQUEST)
        await store.start_attempt("j")
        retrying = gateway_pb2.JobEvent(retrying=gateway_pb2.Retrying(attempt=2, max_attempts=2, reason="stall"))
        assert (await store.requeue("j", retrying)).retrying.reason == "stall"
        job = await store.get_job("j")
        assert (job.state, job.attempts) == (QUEUED, 1)
        await store.start_attempt("j")
        await store.requeue("j", retrying, count_attempt=False)
        assert (await store.get_job("j")).attempts == 1

    backend.run(check)


def test_long_error_keeps_its_end(backend):
    async def check(store):
        await store.submit("j", REQUEST)
        message = "Traceback (most recent call last):\n" + "  frame\n" * 5000 + "RuntimeError: CUDA out of memory"
        failed = gateway_pb2.Failed(code=grpc.StatusCode.INTERNAL.value[0], code_name="INTERNAL", message=message)
        event = await store.finish("j", FAILED, gateway_pb2.JobEvent(failed=failed))
        kept_messages = (
            (await store.get_job("j")).error.message,
            event.failed.message,
            (await store.events("j"))[0].failed.message,
        )
        for kept in kept_messages:
            assert kept.endswith("RuntimeError: CUDA out of memory")
            assert len(kept) <= MAX_ERROR_CHARS + len("...\n")
            assert not kept.startswith("Traceback")

    backend.run(check)


def test_a_restart_spends_no_attempt_and_ends_a_job_caught_in_a_stage_by_more_than_the_bound(backend):
    """The job runner's restart policy (JobRunner.resume) on the store a dead gateway left behind, eleven restarts
    in a row: a restart spends none of a job's `max_attempts` (not even of one whose attempts a stall spent); a
    restart that caught one of its stage calls in progress is one of its MAX_RESTART_RERUNS re-runs, and the next
    one fails it ABORTED with the reason; a job only waiting in a queue re-runs free every time."""
    from h3serve.gateway.jobs.events import EventHub
    from h3serve.gateway.jobs.runner import INTERRUPTED, MAX_RESTART_RERUNS, JobRunner
    from h3serve.gateway.metrics import GatewayMetrics
    from h3serve.gateway.stages import STAGE_NAMES
    from h3serve.gateway.stages.calls import StageCaller

    assert MAX_RESTART_RERUNS == 10

    async def run_again(store, attempt: dict[str, int]):
        """The jobs re-run by a restart are where the gateway left them when it died: 'running' in its dit call,
        'worn' in its vae call, 'waited' queued for an encoder that never took it ('queued' never starts)."""
        assert await store.start_attempt("running") == attempt["running"]
        encoder = await store.stage_enqueued("running", attempt["running"], "encoder")
        await store.stage_update(encoder, started=1.0, finished=2.0)
        await store.append_event("running", gateway_pb2.JobEvent(encoding=gateway_pb2.Encoding()))
        dit = await store.stage_enqueued("running", attempt["running"], "dit")
        await store.stage_update(dit, started=3.0)
        await store.append_event("running", gateway_pb2.JobEvent(denoising=gateway_pb2.Denoising(step=1)))
        assert await store.start_attempt("waited") == attempt["waited"]
        await store.stage_enqueued("waited", attempt["waited"], "encoder")
        await store.append_event("waited", gateway_pb2.JobEvent(waiting=gateway_pb2.Waiting(stage="encoder")))
        assert await store.start_attempt("worn") == attempt["worn"]
        vae = await store.stage_enqueued("worn", attempt["worn"], "vae")
        await store.stage_update(vae, started=4.0)
        await store.append_event("worn", gateway_pb2.JobEvent(decoding=gateway_pb2.Decoding()))

    async def leave_behind():
        store = await backend.open()
        for job_id in ("queued", "running", "waited", "worn", "done", "cancelled"):
            await store.submit(job_id, REQUEST, first_event=gateway_pb2.JobEvent(accepted=gateway_pb2.Accepted()))
        assert await store.start_attempt("worn") == 1  # its first attempt stalled: its second is its last
        assert await store.requeue("worn", gateway_pb2.JobEvent(retrying=gateway_pb2.Retrying(attempt=2)))
        await run_again(store, {"running": 1, "waited": 1, "worn": 2})
        await store.finish("done", SUCCEEDED, gateway_pb2.JobEvent(done=gateway_pb2.Done()))
        await store.finish("cancelled", CANCELLED, CANCEL)
        await store.close()

    async def restart(n: int):
        """The n-th gateway start after a death, on what the dead gateway left behind."""
        store, config = await backend.open(), GatewayConfig(max_attempts=2)
        metrics = GatewayMetrics(STAGE_NAMES)
        runner = JobRunner(config, store, EventHub(store), StageCaller(config, metrics), None, metrics, None)
        started = []
        runner.start = lambda job_id, request: started.append((job_id, request))
        await runner.resume()
        await runner.caller.close()
        assert all(request == REQUEST for _, request in started)
        queued = await store.get_job("queued")
        assert (queued.state, queued.attempts) == (QUEUED, 0)
        assert [e.WhichOneof("kind") for e in await store.events("queued")] == ["accepted"]
        waited = await store.get_job("waited")
        assert (waited.state, waited.attempts) == (QUEUED, 0), "a re-run from a queue is free, however many"
        assert (await store.events("waited"))[-1].retrying == gateway_pb2.Retrying(
            attempt=1,
            max_attempts=2,
            reason="the gateway restarted while this job waited for the encoder stage; attempt not counted",
        )
        assert [(r.stage, r.error) for r in waited.stage_records] == [("encoder", INTERRUPTED)] * n
        assert {job.job_id: job.restarts for job in await store.unfinished()}["waited"] == 0
        running, worn = await store.get_job("running"), await store.get_job("worn")
        if n <= MAX_RESTART_RERUNS:
            assert [job_id for job_id, _ in started] == ["queued", "running", "waited", "worn"]
            reason = (
                f"the gateway restarted while this job was in the {{}} stage; re-run {n} of "
                f"{MAX_RESTART_RERUNS} after a restart; attempt not counted"
            )
            assert (running.state, running.attempts) == (QUEUED, 0)
            assert (await store.events("running"))[-1].retrying == gateway_pb2.Retrying(
                attempt=1, max_attempts=2, reason=reason.format("dit")
            )
            assert [(r.stage, r.error) for r in running.stage_records if not r.finished] == [("dit", INTERRUPTED)] * n
            assert (worn.state, worn.attempts) == (QUEUED, 1), "a restart spends no attempt, even the last"
            assert (await store.events("worn"))[-1].retrying == gateway_pb2.Retrying(
                attempt=2, max_attempts=2, reason=reason.format("vae")
            )
            assert [(r.stage, r.error) for r in worn.stage_records] == [("vae", INTERRUPTED)] * n
            assert {job.job_id: job.restarts for job in await store.unfinished()} == {
                "queued": 0,
                "running": n,
                "waited": 0,
                "worn": n,
            }
            await run_again(store, {"running": 1, "waited": 1, "worn": 2})
        else:  # caught in a stage by an eleventh restart: the bound ends them, the others run on
            assert [job_id for job_id, _ in started] == ["queued", "waited"]
            for job, where in ((running, "dit"), (worn, "vae")):
                assert job.state == FAILED and job.error == gateway_pb2.Failed(
                    code=grpc.StatusCode.ABORTED.value[0],
                    code_name="ABORTED",
                    message=(
                        f"the gateway restarted while this job was in the {where} stage: {MAX_RESTART_RERUNS + 1} "
                        "restarts caught one of its stages in progress; restarts spend none of its 2 attempts, but "
                        f"after {MAX_RESTART_RERUNS} such re-runs the job ends, in case it is what brings the gateway "
                        "down"
                    ),
                )
                assert (await store.events(job.job_id))[-1].failed == job.error
                assert [r.stage for r in job.stage_records if not r.finished] == [where] * n, "one pass a restart"
                assert await store.start_attempt(job.job_id) == 0
            assert [job.job_id for job in await store.unfinished()] == ["queued", "waited"]
        assert (await store.get_job("done")).state == SUCCEEDED
        assert (await store.get_job("cancelled")).state == CANCELLED
        await store.close()

    run(leave_behind())
    for n in range(1, MAX_RESTART_RERUNS + 2):
        run(restart(n))


# Artifact files.


def test_artifact_save_bytes(tmp_path):
    data = os.urandom(300_000)
    artifact, key = ArtifactStore(DirectoryBlobs(str(tmp_path))).save("abc", "video", data)
    assert key == "artifacts/h3-abc.mp4"
    path = tmp_path / "artifacts" / "h3-abc.mp4"
    assert artifact == gateway_pb2.Artifact(
        artifact_id="abc-video",
        file_name="h3-abc.mp4",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        media_type="video/mp4",
    )
    with open(path, "rb") as f:
        assert f.read() == data
    assert os.listdir(tmp_path / "artifacts") == ["h3-abc.mp4"]


def test_artifact_save_chunks(tmp_path):
    chunks = [b"one", bytearray(b"two"), memoryview(b"three")]
    artifact, key = ArtifactStore(DirectoryBlobs(str(tmp_path))).save("abc", "raw", iter(chunks))
    assert (artifact.file_name, artifact.artifact_id, artifact.media_type) == (
        "h3-abc.npz",
        "abc-raw",
        "application/x-npz",
    )
    assert artifact.bytes == 11 and artifact.sha256 == hashlib.sha256(b"onetwothree").hexdigest()
    with open(tmp_path / key, "rb") as f:
        assert f.read() == b"onetwothree"


def test_artifact_failed_write_leaves_previous_file(tmp_path):
    artifacts = ArtifactStore(DirectoryBlobs(str(tmp_path)))
    _, key = artifacts.save("abc", "video", b"complete")

    def broken():
        yield b"partial"
        raise OSError("encoder died")

    with pytest.raises(OSError, match="encoder died"):
        artifacts.save("abc", "video", broken())
    with open(tmp_path / key, "rb") as f:
        assert f.read() == b"complete"
    assert os.listdir(tmp_path / "artifacts") == ["h3-abc.mp4"]  # no temporary file left behind


def test_artifact_rejects_bad_kind_and_id(tmp_path):
    artifacts = ArtifactStore(DirectoryBlobs(str(tmp_path)))
    with pytest.raises(ValueError):
        artifacts.save("abc", "audio", b"x")
    with pytest.raises(ValueError):
        artifacts.save("../abc", "video", b"x")
    assert os.listdir(tmp_path) == []


# The bin (soft delete), listing order and cursors.


def _finish(store, job_id):
    return store.finish(job_id, SUCCEEDED, gateway_pb2.JobEvent(done=gateway_pb2.Done()))


def test_the_bin_marks_and_restores_a_job_and_never_touches_its_state(backend):
    async def check(store):
        await store.submit("j", REQUEST)
        await store.start_attempt("j")
        await store.finish("j", CANCELLED, CANCEL)
        before = await store.get_job("j")
        binned = await store.set_deleted("j", True)
        assert binned.deleted >= before.updated and binned.state == CANCELLED
        assert (await store.get_job("j")) == binned, "GetJob still finds a job in the bin"
        assert (await store.set_deleted("j", True)).deleted == binned.deleted, "a second delete keeps the first time"
        restored = await store.set_deleted("j", False)
        assert restored.deleted == 0 and restored.state == CANCELLED
        restored.ClearField("deleted")
        binned.ClearField("deleted")
        assert restored == binned, "only the bin mark changed"
        assert (await store.set_deleted("j", False)).deleted == 0
        assert await store.set_deleted("ghost", True) is None and await store.set_deleted("ghost", False) is None

    backend.run(check)


def _pages(store, limit, **options):
    """Every page of a listing, by the cursor each page returns."""

    async def walk():
        pages, cursor = [], 0
        while True:
            jobs, cursor = await store.list_jobs([], limit, cursor, **options)
            pages.append([job.job_id for job in jobs])
            if not cursor:
                return pages

    return walk()


def test_listing_filters_the_bin_and_pages_in_both_orders(backend):
    ids = [f"j{i}" for i in range(7)]

    async def check(store):
        for job_id in ids:
            await store.submit(job_id, REQUEST)
        for job_id in ("j1", "j4"):
            await store.set_deleted(job_id, True)
        await _finish(store, "j5")
        kept = [i for i in ids if i not in ("j1", "j4")]
        assert await _pages(store, 2) == [["j6", "j5"], ["j3", "j2"], ["j0"]]
        assert await _pages(store, 2, oldest_first=True) == [["j0", "j2"], ["j3", "j5"], ["j6"]]
        assert await _pages(store, 5, deleted=True) == [["j4", "j1"]]
        assert await _pages(store, 5, deleted=True, oldest_first=True) == [["j1", "j4"]]
        assert [j.job_id for j in (await store.list_jobs([SUCCEEDED], 9))[0]] == ["j5"]
        assert [j.job_id for j in (await store.list_jobs([QUEUED], 9, deleted=True))[0]] == ["j4", "j1"]
        every, _ = await store.list_jobs([], 100)
        assert [j.job_id for j in every] == kept[::-1] and all(j.deleted == 0 for j in every)
        # A job's position continues after it, also from a job the filters leave out (j4 is in the bin).
        for order, expected in ((False, ["j3", "j2"]), (True, ["j5", "j6"])):
            jobs, _ = await store.list_jobs([], 2, await store.position("j4"), oldest_first=order)
            assert [j.job_id for j in jobs] == expected
        assert await store.position("ghost") == 0

    backend.run(check)


def test_a_listing_carries_each_jobs_artifacts_and_timings_but_not_its_records(backend):
    async def check(store):
        for job_id in ("a", "b", "c"):
            await store.submit(job_id, REQUEST)
            await store.stage_enqueued(job_id, 1, "encoder")
        for job_id in ("a", "c"):
            await store.add_artifact(job_id, "raw", _artifact(job_id, "raw"), f"/data/{job_id}.npz")
            await store.add_artifact(job_id, "video", _artifact(job_id, "video"), f"/data/{job_id}.mp4")
            await store.set_stage_seconds(job_id, "encode", 1.0)
            await store.set_stage_seconds(job_id, "denoise", 2.0)
        listed, _ = await store.list_jobs([], 10)
        assert [j.job_id for j in listed] == ["c", "b", "a"]
        for job in listed:
            one = await store.get_job(job.job_id)
            assert len(one.stage_records) == 1 and not job.stage_records
            one.ClearField("stage_records")
            assert job == one, "a listed job is its GetJob without the stage records"
        assert [a.artifact_id for a in listed[0].artifacts] == ["c-video", "c-raw"] and not listed[1].artifacts
        assert [s.stage for s in listed[2].stages] == ["encode", "denoise"]

    backend.run(check)


# Progress.


def _event(**kind):
    return gateway_pb2.JobEvent(**kind)


ENCODING = _event(encoding=gateway_pb2.Encoding())


def _denoising(step, total=8):
    return _event(denoising=gateway_pb2.Denoising(step=step, total=total))


def test_progress_follows_the_documented_formula():
    from h3serve.gateway.jobs.progress import advance, progress

    conditioning = [_event(conditioning=gateway_pb2.Conditioning(done=d, total=4)) for d in (1, 4)]
    assert [advance(0.0, e) for e in conditioning] == [pytest.approx(0.0125), pytest.approx(0.05)]
    assert advance(0.0, ENCODING) == 0.05
    assert advance(0.05, _denoising(2)) == pytest.approx(0.05 + 0.8 * 2 / 8)
    assert advance(0.5, _event(decoding=gateway_pb2.Decoding(chunk=1, total=4))) == pytest.approx(0.875)
    assert advance(0.9, _event(muxing=gateway_pb2.Muxing(done=3, total=5))) == pytest.approx(0.98)
    assert advance(0.98, _event(done=gateway_pb2.Done())) == 1.0
    for unchanged in (
        _event(accepted=gateway_pb2.Accepted()),
        _event(waiting=gateway_pb2.Waiting()),
        _event(failed=gateway_pb2.Failed()),
        CANCEL,
    ):
        assert advance(0.42, unchanged) == 0.42, unchanged
    assert advance(0.42, _event(retrying=gateway_pb2.Retrying(attempt=2))) == 0.0
    # Encoder and VAE encoder run together: a late conditioning event does not move the bar back.
    assert advance(0.05, conditioning[0]) == 0.05
    assert advance(0.3, _denoising(0, total=0)) == 0.3 and advance(0.0, _denoising(9)) == pytest.approx(0.85)
    assert progress([]) == 0.0
    assert progress([ENCODING, _denoising(4), CANCEL]) == pytest.approx(0.45)
    assert progress([ENCODING, _denoising(8), _event(retrying=gateway_pb2.Retrying()), ENCODING]) == 0.05


def test_the_stored_progress_advances_with_every_event_in_its_transaction(backend):
    from h3serve.gateway.jobs.progress import progress

    async def check(store):
        await store.submit("j", REQUEST, first_event=_event(accepted=gateway_pb2.Accepted()))
        assert (await store.get_job("j")).progress == 0.0
        await store.start_attempt("j")
        seen = []
        for event in (ENCODING, _denoising(1), _denoising(4)):
            await store.append_event("j", event)
            seen.append((await store.get_job("j")).progress)
        assert seen == [0.05, pytest.approx(0.15), pytest.approx(0.45)]
        await store.requeue("j", _event(retrying=gateway_pb2.Retrying(attempt=2)))
        assert (await store.get_job("j")).progress == 0.0
        await store.start_attempt("j")
        await store.append_event("j", ENCODING)
        await store.append_event("j", _denoising(6))
        await store.finish("j", FAILED, _event(failed=gateway_pb2.Failed(code_name="INTERNAL", message="x")))
        job = await store.get_job("j")
        assert job.progress == pytest.approx(0.65) == progress(await store.events("j")), "failed keeps its progress"
        assert (await store.list_jobs([], 1))[0][0].progress == job.progress
        await store.submit("k", REQUEST)
        await _finish(store, "k")
        assert (await store.get_job("k")).progress == 1.0

    backend.run(check)


# The file a gateway from before the bin and progress left behind (and before attempts and request ids).
OLD_SCHEMA = """
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, state INTEGER NOT NULL, request BLOB NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL, error BLOB, last_seq INTEGER NOT NULL DEFAULT 0);
CREATE TABLE events (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, event BLOB NOT NULL,
    PRIMARY KEY (job_id, seq));
"""


def test_an_old_database_gains_the_bin_and_progress_in_place(db_path):
    os.makedirs(os.path.dirname(db_path))
    old_events = {
        "old": [_event(accepted=gateway_pb2.Accepted()), ENCODING, _denoising(4)],
        "older": [_event(accepted=gateway_pb2.Accepted()), ENCODING, _event(done=gateway_pb2.Done())],
        "never": [],
    }
    with closing(sqlite3.connect(db_path)) as conn, conn:
        conn.executescript(OLD_SCHEMA)
        for job_id, events in old_events.items():
            conn.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, 1.0, 2.0, NULL, ?)",
                (job_id, RUNNING, REQUEST.SerializeToString(), len(events)),
            )
            conn.executemany(
                "INSERT INTO events VALUES (?, ?, 1.5, ?)",
                [(job_id, seq, e.SerializeToString()) for seq, e in enumerate(events, 1)],
            )

    async def check(store):
        jobs = {job.job_id: job for job in (await store.list_jobs([], 10))[0]}
        assert {job_id: (job.progress, job.deleted, job.attempts) for job_id, job in jobs.items()} == {
            "old": (pytest.approx(0.45), 0.0, 0),
            "older": (1.0, 0.0, 0),
            "never": (0.0, 0.0, 0),
        }
        assert (await store.append_event("old", _denoising(8))).seq == 4
        assert (await store.get_job("old")).progress == pytest.approx(0.85)
        assert (await store.set_deleted("older", True)).deleted > 0
        assert [j.job_id for j in (await store.list_jobs([], 10, deleted=True))[0]] == ["older"]

    with_store(db_path, check)
    with closing(sqlite3.connect(db_path)) as conn:
        columns = {row[1]: row for row in conn.execute("PRAGMA table_info(jobs)")}
        assert columns["deleted"][2:5] == ("REAL", 1, "0") and conn.execute(
            "SELECT COUNT(*) FROM jobs WHERE progress IS NULL"
        ).fetchone() == (0,)
    with_store(db_path, lambda store: _expect_progress(store, "old", 0.85))  # a second open changes nothing


async def _expect_progress(store, job_id, value):
    assert (await store.get_job(job_id)).progress == pytest.approx(value)
