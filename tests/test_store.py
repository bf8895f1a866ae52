"""The gateway's durable job store and artifact files, on real SQLite files and directories."""

import hashlib
import os
import sqlite3
import threading
from contextlib import closing

import grpc
import pytest

from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.jobs.store import JobStore
from h3serve.v1 import common_pb2, gateway_pb2
from h3serve.common.errors import MAX_ERROR_CHARS

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    gateway_pb2.JOB_STATE_QUEUED, gateway_pb2.JOB_STATE_RUNNING, gateway_pb2.JOB_STATE_SUCCEEDED,
    gateway_pb2.JOB_STATE_FAILED, gateway_pb2.JOB_STATE_CANCELLED)

REQUEST = gateway_pb2.ResolvedRequest(prompt="a fox", height=768, width=1344, num_frames=124, num_inference_steps=50,
                                      seed=2**62 + 5, include_raw=True, workflow=common_pb2.WORKFLOW_T2VA)


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "nested" / "jobs.sqlite")


@pytest.fixture
def store(db_path):
    store = JobStore(db_path)
    yield store
    store.close()


def _artifact(job_id, kind, size=10):
    extension = ".mp4" if kind == "video" else ".npz"
    return gateway_pb2.Artifact(artifact_id=f"{job_id}-{kind}", file_name=f"h3-{job_id}{extension}", bytes=size,
                                sha256="ab" * 32, media_type="video/mp4" if kind == "video" else "application/x-npz")


def test_journal_mode_is_wal(store, db_path):
    with closing(sqlite3.connect(db_path)) as other:
        assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_round_trip_survives_reopen(db_path):
    store = JobStore(db_path)
    created = store.create_job("j1", REQUEST)
    assert created.state == QUEUED and created.request == REQUEST
    store.append_event("j1", gateway_pb2.JobEvent(accepted=gateway_pb2.Accepted(request=REQUEST)))
    assert store.set_state("j1", RUNNING)
    store.append_event("j1", gateway_pb2.JobEvent(denoising=gateway_pb2.Denoising(step=1, total=49)))
    store.set_stage_seconds("j1", "encode", 1.5)
    store.set_stage_seconds("j1", "denoise", 30.0)
    store.set_stage_seconds("j1", "encode", 2.5)  # rewritten in place, keeps its position
    store.add_artifact("j1", "raw", _artifact("j1", "raw"), "/data/h3-j1.npz")
    store.add_artifact("j1", "video", _artifact("j1", "video"), "/data/h3-j1.mp4")
    assert store.set_state("j1", SUCCEEDED)
    store.close()

    reopened = JobStore(db_path)
    job = reopened.get_job("j1")
    assert job.job_id == "j1" and job.state == SUCCEEDED and job.request == REQUEST
    assert job.created == created.created and job.updated >= job.created
    assert [a.artifact_id for a in job.artifacts] == ["j1-video", "j1-raw"]
    assert job.artifacts[0] == _artifact("j1", "video")
    assert [(s.stage, s.seconds) for s in job.stages] == [("encode", 2.5), ("denoise", 30.0)]
    assert not job.HasField("error")
    assert job.last_event_seq == 2
    events = reopened.events("j1")
    assert [e.WhichOneof("kind") for e in events] == ["accepted", "denoising"]
    assert events[0].accepted.request == REQUEST and events[1].denoising.step == 1
    assert reopened.artifact("j1-raw") == (_artifact("j1", "raw"), "/data/h3-j1.npz")
    assert reopened.artifact("nope") is None
    assert reopened.get_job("nope") is None
    reopened.close()


def test_seq_is_one_to_n_and_ordered(store):
    store.create_job("j", REQUEST)
    stored = [store.append_event("j", gateway_pb2.JobEvent(decoding=gateway_pb2.Decoding(chunk=i, total=5)))
              for i in range(1, 6)]
    assert [e.seq for e in stored] == [1, 2, 3, 4, 5]
    assert all(e.job_id == "j" and e.time > 0 for e in stored)
    assert [e.time for e in stored] == sorted(e.time for e in stored)
    assert store.events("j") == stored
    assert store.events("j", after_seq=3) == stored[3:]
    assert store.events("other") == []


def test_append_event_unknown_job(store):
    with pytest.raises(KeyError):
        store.append_event("ghost", gateway_pb2.JobEvent(cancelled=gateway_pb2.Cancelled(reason="x")))


def test_concurrent_appends_get_unique_contiguous_seqs(store):
    store.create_job("j", REQUEST)
    threads, per_thread = 8, 25
    start = threading.Barrier(threads)
    returned = [[] for _ in range(threads)]

    def append(t):
        start.wait()
        for i in range(per_thread):
            event = gateway_pb2.JobEvent(decoding=gateway_pb2.Decoding(chunk=i, total=t))
            returned[t].append(store.append_event("j", event).seq)

    workers = [threading.Thread(target=append, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    total = threads * per_thread
    assert sorted(seq for seqs in returned for seq in seqs) == list(range(1, total + 1))
    assert all(seqs == sorted(seqs) for seqs in returned)
    assert [e.seq for e in store.events("j")] == list(range(1, total + 1))
    assert store.get_job("j").last_event_seq == total


def test_recover_reruns_queued_and_interrupted_jobs_until_attempts_run_out(db_path):
    store = JobStore(db_path)
    for job_id in ("queued", "running", "worn", "done", "cancelled"):
        store.create_job(job_id, REQUEST)
    assert store.start_attempt("running") == 1
    store.stage_enqueued("running", 1, "dit")
    for _ in range(2):
        assert store.start_attempt("worn") >= 1
    store.stage_enqueued("worn", 2, "vae")
    store.set_state("done", SUCCEEDED)
    store.set_state("cancelled", CANCELLED)
    assert store.start_attempt("done") == 0, "a final job never runs again"
    store.close()

    store = JobStore(db_path)
    recovery = store.recover(max_attempts=2)
    assert [job_id for job_id, _ in recovery.rerun] == ["queued", "running"]
    assert all(request == REQUEST for _, request in recovery.rerun)
    assert recovery.failed == ["worn"]
    assert store.get_job("queued").state == QUEUED and store.events("queued") == []
    running = store.get_job("running")
    assert running.state == QUEUED and running.attempts == 1
    assert store.events("running")[-1].retrying == gateway_pb2.Retrying(
        attempt=2, max_attempts=2, reason="the gateway restarted while this job was in the dit stage")
    worn = store.get_job("worn")
    assert worn.state == FAILED and worn.error == gateway_pb2.Failed(
        code=grpc.StatusCode.ABORTED.value[0], code_name="ABORTED",
        message="the gateway restarted while this job was in the vae stage (attempt 2 of 2)")
    assert store.events("worn")[-1].failed == worn.error
    assert store.get_job("done").state == SUCCEEDED and store.events("done") == []
    assert store.get_job("cancelled").state == CANCELLED
    assert store.start_attempt("running") == 2
    store.close()


def test_terminal_state_is_final(store):
    store.create_job("j", REQUEST)
    assert store.set_state("j", RUNNING)
    assert store.set_state("j", CANCELLED)
    assert not store.set_state("j", RUNNING)
    assert not store.set_state("j", FAILED, gateway_pb2.Failed(code_name="INTERNAL", message="late"))
    job = store.get_job("j")
    assert job.state == CANCELLED and not job.HasField("error")
    assert not store.set_state("ghost", RUNNING)


def test_long_error_keeps_its_end(store):
    store.create_job("j", REQUEST)
    message = "Traceback (most recent call last):\n" + "  frame\n" * 5000 + "RuntimeError: CUDA out of memory"
    failed = gateway_pb2.Failed(code=grpc.StatusCode.INTERNAL.value[0], code_name="INTERNAL", message=message)
    assert store.set_state("j", FAILED, failed)
    event = store.append_event("j", gateway_pb2.JobEvent(failed=failed))
    for kept in (store.get_job("j").error.message, event.failed.message, store.events("j")[0].failed.message):
        assert kept.endswith("RuntimeError: CUDA out of memory")
        assert len(kept) <= MAX_ERROR_CHARS + len("...\n")
        assert not kept.startswith("Traceback")


# Artifact files.

def test_artifact_save_bytes(tmp_path):
    data = os.urandom(300_000)
    artifact, path = ArtifactStore(str(tmp_path / "artifacts")).save("abc", "video", data)
    assert path == str(tmp_path / "artifacts" / "h3-abc.mp4")
    assert artifact == gateway_pb2.Artifact(artifact_id="abc-video", file_name="h3-abc.mp4", bytes=len(data),
                                            sha256=hashlib.sha256(data).hexdigest(), media_type="video/mp4")
    with open(path, "rb") as f:
        assert f.read() == data
    assert os.listdir(tmp_path / "artifacts") == ["h3-abc.mp4"]


def test_artifact_save_chunks(tmp_path):
    chunks = [b"one", bytearray(b"two"), memoryview(b"three")]
    artifact, path = ArtifactStore(str(tmp_path)).save("abc", "raw", iter(chunks))
    assert (artifact.file_name, artifact.artifact_id, artifact.media_type) == (
        "h3-abc.npz", "abc-raw", "application/x-npz")
    assert artifact.bytes == 11 and artifact.sha256 == hashlib.sha256(b"onetwothree").hexdigest()
    with open(path, "rb") as f:
        assert f.read() == b"onetwothree"


def test_artifact_failed_write_leaves_previous_file(tmp_path):
    artifacts = ArtifactStore(str(tmp_path))
    _, path = artifacts.save("abc", "video", b"complete")

    def broken():
        yield b"partial"
        raise OSError("encoder died")

    with pytest.raises(OSError, match="encoder died"):
        artifacts.save("abc", "video", broken())
    with open(path, "rb") as f:
        assert f.read() == b"complete"
    assert os.listdir(tmp_path) == ["h3-abc.mp4"]  # no temporary file left behind


def test_artifact_rejects_bad_kind_and_id(tmp_path):
    artifacts = ArtifactStore(str(tmp_path))
    with pytest.raises(ValueError):
        artifacts.save("abc", "audio", b"x")
    with pytest.raises(ValueError):
        artifacts.save("../abc", "video", b"x")
    assert os.listdir(tmp_path) == []
