"""Gateway parts without model processes: stage queues, the watchdog, the retry policy over real gRPC,
submission rules of the store, listings and artifact retention."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from stores import with_store

from h3serve.common.config import GatewayConfig
from h3serve.gateway.blobs import DirectoryBlobs
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.jobs.retention import Retention
from h3serve.gateway.jobs.runner import all_of
from h3serve.gateway.jobs.store import QueueFull, RequestIdConflict
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages import STAGE_NAMES
from h3serve.gateway.stages import calls as stage_calls
from h3serve.gateway.stages.calls import CallRecord, StageCaller, StageFailed
from h3serve.gateway.stages.queue import StageQueue
from h3serve.gateway.stages.stage import JobContext
from h3serve.gateway.stages.watchdog import Stuck, Watchdog
from h3serve.v1 import dit_pb2, dit_pb2_grpc, encoder_pb2_grpc, gateway_pb2, tensor_pb2

S = gateway_pb2
REQUEST = S.ResolvedRequest(prompt="a fox", height=32, width=64, num_frames=124)
DONE = S.JobEvent(done=S.Done())
FAILED = S.JobEvent(failed=S.Failed(code_name="INTERNAL", message="test"))


def run(coro):
    return asyncio.run(coro)


async def wait_forever(cancelled: asyncio.Event) -> None:
    """A call that never answers; `cancelled` is set when it is cancelled."""
    try:
        await asyncio.Event().wait()
    finally:
        cancelled.set()


# Stage queues.


def test_stage_queue_is_fifo_and_a_cancelled_waiter_leaves_it():
    async def scenario():
        queue, order, release = StageQueue("dit", workers=1), [], asyncio.Event()

        async def job(name):
            async with queue.worker():
                order.append(name)
                await release.wait()

        tasks = [asyncio.create_task(job(name)) for name in "abcd"]
        await asyncio.sleep(0)
        assert (queue.busy, queue.depth, order) == (1, 3, ["a"])
        tasks[2].cancel()  # "c" gives up while waiting
        await asyncio.sleep(0)
        assert queue.depth == 2
        release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == ["a", "b", "d"] and (queue.busy, queue.depth) == (0, 0)

    run(scenario())


def test_stage_queue_runs_as_many_as_it_has_workers():
    async def scenario():
        queue, release = StageQueue("encoder", workers=2), asyncio.Event()

        async def job():
            async with queue.worker():
                await release.wait()

        tasks = [asyncio.create_task(job()) for _ in range(3)]
        await asyncio.sleep(0)
        assert (queue.busy, queue.depth) == (2, 1)
        release.set()
        await asyncio.gather(*tasks)
        assert queue.busy == 0

    run(scenario())
    with pytest.raises(ValueError, match="at least one worker"):
        StageQueue("vae", 0)


@pytest.mark.parametrize("turns", [False, True])
def test_stages_take_turns_on_a_shared_card_only_when_told(tmp_path, turns):
    """Three jobs, each in another stage at once: they overlap, unless `stages_take_turns` makes them wait for the
    card, in arrival order."""
    from h3serve.gateway.jobs.events import EventHub
    from h3serve.gateway.jobs.runner import JobRunner

    async def scenario(store):
        config = GatewayConfig(stages_take_turns=turns)
        metrics = GatewayMetrics(STAGE_NAMES)
        runner = JobRunner(config, store, EventHub(store), StageCaller(config, metrics), None, metrics, None)
        running: list[str] = []
        order, most = [], 0

        async def call(stage, job, record, watchdog):
            nonlocal most
            running.append(stage.name)
            order.append(stage.name)
            most = max(most, len(running))
            await asyncio.sleep(0.05)
            running.remove(stage.name)

        runner.caller.run = call
        stages = [runner.caller.stages[name] for name in ("encoder", "dit", "vae")]
        for job_id, _ in zip("abc", stages, strict=True):
            await store.submit(job_id, REQUEST, first_event=S.JobEvent(accepted=S.Accepted()))
            await store.start_attempt(job_id)
        jobs = [JobContext(job_id, REQUEST, [], None, None) for job_id in "abc"]
        await asyncio.gather(*(runner._stage(job, 1, stage) for job, stage in zip(jobs, stages, strict=True)))
        await runner.caller.close()
        assert (most, order) == ((1, ["encoder", "dit", "vae"]) if turns else (3, order))

    with_store(tmp_path / "jobs.db", scenario)


# The watchdog.


def test_watchdog_cancels_a_silent_call_and_names_its_phase():
    async def scenario():
        cancelled = asyncio.Event()
        with pytest.raises(Stuck) as err:
            await Watchdog({"encode": 0.2}).run("encode", wait_forever(cancelled))
        assert str(err.value) == "stuck in encode for 0.2 s" and cancelled.is_set()

    run(scenario())


def test_watchdog_limits_are_per_phase_and_progress_keeps_a_call_alive():
    async def scenario():
        watchdog = Watchdog({"decode": 30.0, "mux": 0.2})

        async def decode_then_stall_in_mux():
            for _ in range(20):
                await asyncio.sleep(0.01)
                watchdog.progress("decode")
            watchdog.progress("mux")
            await asyncio.Event().wait()

        async def progressing():
            for _ in range(20):
                await asyncio.sleep(0.01)
                watchdog.progress("decode")
            return "decoded"

        assert await watchdog.run("decode", progressing()) == "decoded"
        with pytest.raises(Stuck, match="stuck in mux for 0.2 s"):
            await watchdog.run("decode", decode_then_stall_in_mux())

    run(scenario())
    with pytest.raises(ValueError, match="unknown phase"):
        Watchdog({"sleep": 1.0})


def test_a_cancelled_watchdog_leaves_no_task_behind():
    """A job cancelled while its stage call runs (CancelJob, shutdown) must not leave a pending task for the garbage
    collector: asyncio then logs "Task was destroyed but it is pending!" (it did, during Watch / cancel / resubmit)."""
    import gc

    async def scenario():
        loop, problems = asyncio.get_running_loop(), []
        loop.set_exception_handler(lambda _, context: problems.append(context["message"]))
        cancelled = asyncio.Event()
        call = asyncio.create_task(Watchdog({"denoise": 30.0}).run("denoise", wait_forever(cancelled)))
        await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        assert cancelled.is_set() and call.cancelled()
        for _ in range(3):
            await asyncio.sleep(0)
            gc.collect()
        assert problems == []
        assert len(asyncio.all_tasks()) == 1, "only this scenario is left"

    run(scenario())


# Retries: only transient codes, moving between replicas.


class FailingEncoder(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, code: grpc.StatusCode):
        self.code, self.calls = code, 0

    async def Encode(self, request, context):
        self.calls += 1
        await context.abort(self.code, f"refused by a test replica ({self.code.name})")


async def _encode_against(code: grpc.StatusCode, outage_s: float = 0.3):
    servers, servicers, addresses = [], [], []
    for _ in range(2):
        server, servicer = grpc.aio.server(), FailingEncoder(code)
        encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
        servicers.append(servicer)
    metrics = GatewayMetrics(STAGE_NAMES)
    config = GatewayConfig(encoder=addresses, retry_backoff_s=0.01, max_backoff_s=0.05, outage_s={"encoder": outage_s})
    caller, record, events = StageCaller(config, metrics), CallRecord(), []

    async def emit(**event):
        events.append(event)

    job = JobContext("job", REQUEST, [], read_asset=None, emit=emit)
    started = time.monotonic()
    try:
        with pytest.raises(StageFailed) as err:
            await caller.run(caller.stages["encoder"], job, record, Watchdog({}))
        stats = [r.info("encoder") for r in caller.replicas["encoder"].replicas]
    finally:
        await caller.close()
        for server in servers:
            await server.stop(None)
    retries = metrics.registry.get_sample_value("h3serve_stage_retries_total", {"stage": "encoder"})
    return err.value, [s.calls for s in servicers], record, retries, events, stats, time.monotonic() - started


def test_invalid_argument_is_never_retried():
    error, calls, record, retries, events, stats, _ = run(_encode_against(grpc.StatusCode.INVALID_ARGUMENT))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and sum(calls) == 1 and record.tries == 1 and retries == 0
    assert str(error).endswith("refused by a test replica (INVALID_ARGUMENT)") and events == []
    failed = [s for s in stats if s.calls]
    assert len(failed) == 1 and failed[0].healthy and failed[0].failures == 1, (
        "a bad request is not the replica's fault"
    )
    assert failed[0].last_error == "INVALID_ARGUMENT: refused by a test replica (INVALID_ARGUMENT)"


def test_unavailable_is_tried_on_every_replica_until_the_outage_limit():
    error, calls, record, retries, events, stats, seconds = run(_encode_against(grpc.StatusCode.UNAVAILABLE))
    assert error.code == grpc.StatusCode.UNAVAILABLE and seconds >= 0.3
    assert str(error).endswith("no encoder replica took the call for 0.3 s (its outage limit)")
    assert min(calls) >= 2 and abs(calls[0] - calls[1]) <= 1, "tries alternate between the replicas"
    assert record.tries == sum(calls) and retries == record.tries - 1
    assert events == [
        {
            "waiting": S.Waiting(
                stage="encoder", limit_s=0.3, reason="UNAVAILABLE: refused by a test replica (UNAVAILABLE)"
            )
        }
    ]
    assert all(not s.healthy and s.failures == s.calls for s in stats)


class RefusingDiT(dit_pb2_grpc.DiTServicer):
    """Ends the call after the first message without reading the rest: what a process that dies mid-upload does."""

    async def Denoise(self, request_iterator, context):
        await request_iterator.__anext__()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "gone")


def test_a_call_broken_while_its_request_is_sent_is_transient_and_other_internal_errors_are_not():
    async def broken_upload() -> grpc.aio.AioRpcError:
        server = grpc.aio.server()
        dit_pb2_grpc.add_DiTServicer_to_server(RefusingDiT(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        chunk = dit_pb2.DenoiseInput(chunk=tensor_pb2.TensorChunk(tensor=tensor_pb2.Tensor(data=bytes(1 << 20))))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for _ in range(20):  # the refusal may, rarely, arrive after the last write: then it is UNAVAILABLE
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        async for _event in dit_pb2_grpc.DiTStub(channel).Denoise(iter([chunk] * 32)):
                            pass
                    if caught.value.code() == grpc.StatusCode.INTERNAL:
                        return caught.value
        finally:
            await server.stop(None)
        raise AssertionError("grpc never reported a broken upload")

    error = run(broken_upload())
    assert (error.code(), error.details()) == stage_calls.BROKEN_UPLOAD and stage_calls._is_transient(error)
    other = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "decode failed")
    assert not stage_calls._is_transient(other)


def test_a_replica_keeps_call_counters_per_stage_and_clears_its_error_when_a_call_succeeds():
    """The VAE replicas serve decode and vae-encode: Info shows each stage's own calls on them."""
    from h3serve.gateway.stages.replicas import Replica

    replica = Replica("vae:1", channel=None)
    replica.stats["vae"].calls, replica.stats["vae-encode"].calls = 3, 1
    replica.failed("vae-encode", "UNAVAILABLE: restarting", down=True)
    assert (replica.info("vae").calls, replica.info("vae-encode").calls, replica.calls) == (3, 1, 4)
    assert (replica.info("vae").last_error, replica.info("vae-encode").last_error) == ("", "UNAVAILABLE: restarting")
    assert not replica.info("vae").healthy
    replica.succeeded("vae-encode")
    assert replica.info("vae-encode").last_error == "" and replica.info("vae-encode").healthy
    replica.health_error, replica.healthy = "health: NOT_SERVING", False
    assert replica.info("vae").last_error == "health: NOT_SERVING", "while down, the probe says why"


# The store: submission rules and listings.


def test_submit_is_idempotent_and_bounded(tmp_path):
    async def scenario(store):
        accepted = S.JobEvent(accepted=S.Accepted(request=REQUEST))
        job, created = await store.submit("j1", REQUEST, "rid", "digest-1", max_unfinished=2, first_event=accepted)
        assert created and job.state == S.JOB_STATE_QUEUED and job.request_id == "rid" and job.last_event_seq == 1
        again, created = await store.submit("j2", REQUEST, "rid", "digest-1", max_unfinished=2)
        assert not created and again.job_id == "j1"
        with pytest.raises(RequestIdConflict, match="already names job j1"):
            await store.submit("j3", REQUEST, "rid", "digest-2", max_unfinished=2)
        await store.submit("j4", REQUEST, max_unfinished=2)
        with pytest.raises(QueueFull) as err:
            await store.submit("j5", REQUEST, max_unfinished=2)
        assert (err.value.depth, err.value.bound) == (2, 2)
        assert await store.get_job("j5") is None and await store.get_job("j3") is None, "a refusal writes nothing"
        assert (await store.submit("j1", REQUEST, "rid", "digest-1", max_unfinished=2))[0].job_id == "j1", (
            "a retried submit is answered even when the queue is full"
        )
        await store.finish("j4", S.JOB_STATE_SUCCEEDED, DONE)
        assert (await store.submit("j5", REQUEST, max_unfinished=2))[1]

    with_store(tmp_path / "jobs.sqlite", scenario)


def test_list_jobs_pages_newest_first(tmp_path):
    async def scenario(store):
        for i in range(5):
            await store.submit(f"j{i}", REQUEST)
        await store.finish("j1", S.JOB_STATE_FAILED, FAILED)
        await store.finish("j3", S.JOB_STATE_FAILED, FAILED)
        first, token = await store.list_jobs([], 2)
        second, token2 = await store.list_jobs([], 2, token)
        third, token3 = await store.list_jobs([], 2, token2)
        assert [[j.job_id for j in page] for page in (first, second, third)] == [["j4", "j3"], ["j2", "j1"], ["j0"]]
        assert token3 == 0
        failed, _ = await store.list_jobs([S.JOB_STATE_FAILED], 10)
        assert [j.job_id for j in failed] == ["j3", "j1"]
        assert await store.count_by_state() == {S.JOB_STATE_QUEUED: 3, S.JOB_STATE_FAILED: 2}

    with_store(tmp_path / "jobs.sqlite", scenario)


def test_stage_records_are_returned_in_order(tmp_path):
    async def scenario(store):
        await store.submit("j", REQUEST)
        first = await store.stage_enqueued("j", 1, "encoder")
        await store.stage_update(first, started=10.0, finished=11.0, replica="h:1", bytes_in=5, bytes_out=700, tries=1)
        second = await store.stage_enqueued("j", 1, "dit")
        await store.stage_update(second, started=12.0, replica="h:2", tries=2, error="UNAVAILABLE: gone")
        records = (await store.get_job("j")).stage_records
        assert [
            (r.stage, r.started, r.finished, r.replica, r.bytes_in, r.bytes_out, r.tries, r.error) for r in records
        ] == [("encoder", 10.0, 11.0, "h:1", 5, 700, 1, ""), ("dit", 12.0, 0.0, "h:2", 0, 0, 2, "UNAVAILABLE: gone")]
        with pytest.raises(ValueError, match="unknown stage record column"):
            await store.stage_update(first, job_id="other")

    with_store(tmp_path / "jobs.sqlite", scenario)


# Artifact retention.


def test_retention_removes_old_then_oldest_beyond_the_byte_cap(tmp_path):
    async def scenario(store):
        artifacts = ArtifactStore(DirectoryBlobs(str(tmp_path)))
        paths = {}
        for job_id, size in (("old", 100), ("mid", 300), ("new", 300)):
            await store.submit(job_id, REQUEST)
            artifact, key = artifacts.save(job_id, "video", os.urandom(size))
            await store.add_artifact(job_id, "video", artifact, key)
            paths[job_id] = tmp_path / key
        created = {a.artifact_id: a.created for a in await store.artifacts_oldest_first()}
        now = created["new-video"]
        assert await Retention(store, artifacts).enforce(now) == [], "no policy: keep everything"
        old_age = now - created["old-video"] - 1e-6
        assert await Retention(store, artifacts, max_age_s=old_age).enforce(now) == ["old-video"]
        assert await Retention(store, artifacts, max_bytes=400).enforce(now) == ["mid-video"]
        assert [a.artifact_id for a in await store.artifacts_oldest_first()] == ["new-video"]
        assert not os.path.exists(paths["old"]) and not os.path.exists(paths["mid"]) and os.path.exists(paths["new"])
        assert await store.artifact("mid-video") is None
        assert [a.artifact_id for a in (await store.get_job("new")).artifacts] == ["new-video"]

    with_store(tmp_path / "jobs.sqlite", scenario)


def test_retention_removes_old_uploads_that_no_queued_or_running_job_names(tmp_path):
    from bench.media_files import audio
    from h3serve.gateway.assets.store import CONTENT, AssetStore, meta_key
    from h3serve.gateway.assets.validate import AssetLimits

    blobs = DirectoryBlobs(str(tmp_path))
    assets = AssetStore(blobs, str(tmp_path / "assets"), AssetLimits())

    async def upload(seconds: float) -> str:
        async def chunks():
            yield S.UploadAssetChunk(file_name="a.wav", data=audio(tmp_path / f"{seconds}.wav", seconds).read_bytes())

        return (await assets.upload(chunks())).asset_id

    async def scenario(store):
        named, loose, fresh = [await upload(seconds) for seconds in (0.5, 0.6, 0.7)]
        for asset_id in (named, loose):
            os.utime(blobs.path(meta_key(asset_id)), (1000.0, 1000.0))  # uploaded long ago
        request = S.ResolvedRequest(prompt="x", workflow=2, first_frame=named)
        await store.submit("queued-job", request)
        retention = Retention(store, ArtifactStore(blobs), assets=assets, asset_max_age_s=3600)
        assert await retention.enforce() == [loose]
        assert await assets.find([named, loose, fresh]) == {a: assets.get(a) for a in (named, fresh)}
        assert not blobs.exists(CONTENT + loose)
        await store.finish("queued-job", S.JOB_STATE_SUCCEEDED, DONE)
        assert await retention.enforce() == [named], "once no unfinished job names it, an old upload goes too"

    with_store(tmp_path / "jobs.sqlite", scenario)


def test_a_failed_stage_of_a_step_cancels_the_others():
    async def scenario():
        cancelled = asyncio.Event()

        async def failing():
            await asyncio.sleep(0)
            raise Stuck("encode", 1.0)

        with pytest.raises(Stuck):
            await all_of(wait_forever(cancelled), failing())
        assert cancelled.is_set()
        assert await all_of(asyncio.sleep(0, "a"), asyncio.sleep(0, "b")) == ["a", "b"]

    run(scenario())
