"""The bin (DeleteJob, RestoreJob, ListJobs' deleted), ListJobs' order and job-id cursor, and Job.progress,
through the real four-process stack."""

from __future__ import annotations

import grpc
import pytest

from h3serve.client import GatewayClient
from h3serve.gateway.jobs.progress import advance
from h3serve.v1 import gateway_pb2 as S

pytestmark = pytest.mark.gateway
SMALL = dict(height=32, width=64, num_inference_steps=8)


@pytest.fixture()
def client(stack):
    client = GatewayClient(stack.address("gateway"))
    yield client
    client.close()


def listed(client, **options) -> list[str]:
    return [job.job_id for job in client.stub.ListJobs(S.ListJobsRequest(page_size=1000, **options)).jobs]


def refused(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request)
    return err.value


def test_delete_cancels_a_running_job_and_restore_brings_it_back(client, dit_hold):
    with dit_hold.armed():  # the job waits at HOLD_STEP: the delete provably lands mid-denoise
        job = client.stub.Submit(
            S.GenerateRequest(prompt="into the bin", seed=5, height=32, width=64, num_inference_steps=40)
        )
        stream = client.stub.Watch(S.WatchRequest(job_id=job.job_id))
        events = []
        for event in stream:
            events.append(event)
            if dit_hold.holds(event):
                break
        binned = client.stub.DeleteJob(S.DeleteJobRequest(job_id=job.job_id))
    events += list(stream)
    assert events[-1].HasField("cancelled"), "the delete really cancelled the run"
    assert [e.denoising.step for e in events if e.HasField("denoising")][-1] < 39
    assert binned.state == S.JOB_STATE_CANCELLED and binned.deleted >= events[-1].time
    values = progress_values(events)
    assert 0.05 < binned.progress == values[-1] < 0.85, "a cancelled job keeps the progress it reached"

    assert job.job_id not in listed(client) and job.job_id in listed(client, deleted=True)
    assert job.job_id in listed(client, deleted=True, states=[S.JOB_STATE_CANCELLED])
    assert client.job(job.job_id) == binned, "GetJob still finds a job in the bin"
    assert client.stub.DeleteJob(S.DeleteJobRequest(job_id=job.job_id)) == binned, "deleting twice: a no-op"

    restored = client.stub.RestoreJob(S.RestoreJobRequest(job_id=job.job_id))
    assert restored.deleted == 0 and restored.state == S.JOB_STATE_CANCELLED
    assert job.job_id in listed(client) and job.job_id not in listed(client, deleted=True)
    assert client.stub.RestoreJob(S.RestoreJobRequest(job_id=job.job_id)) == restored, "restoring twice: a no-op"


def test_a_deleted_finished_job_keeps_its_video(client):
    done = client.generate(S.GenerateRequest(prompt="kept in the bin", seed=6, **SMALL))
    binned = client.stub.DeleteJob(S.DeleteJobRequest(job_id=done.job_id))
    assert binned.state == S.JOB_STATE_SUCCEEDED and binned.deleted > 0 and binned.progress == 1.0
    chunks = list(client.stub.DownloadArtifact(S.DownloadArtifactRequest(artifact_id=done.done.video.artifact_id)))
    assert sum(len(c.data) for c in chunks) == done.done.video.bytes > 0
    assert client.stub.RestoreJob(S.RestoreJobRequest(job_id=done.job_id)).artifacts == binned.artifacts


def test_delete_and_restore_of_an_unknown_job_are_not_found(client):
    for call, request in (
        (client.stub.DeleteJob, S.DeleteJobRequest(job_id="no-such-job")),
        (client.stub.RestoreJob, S.RestoreJobRequest(job_id="no-such-job")),
        (client.stub.ListJobs, S.ListJobsRequest(after_job_id="no-such-job")),
    ):
        err = refused(call, request)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-job" in err.details(), err.details()


def progress_values(events: list[S.JobEvent]) -> list[float]:
    """Job.progress after each event, computed the way a stream consumer does."""
    values, current = [], 0.0
    for event in events:
        current = advance(current, event)
        values.append(current)
    return values


def test_progress_rises_from_zero_to_one_event_by_event(client):
    job = client.stub.Submit(S.GenerateRequest(prompt="a progress bar", seed=7, **SMALL))
    assert job.progress == 0.0
    events = list(client.stub.Watch(S.WatchRequest(job_id=job.job_id)))
    values = progress_values(events)
    assert events[-1].HasField("done") and values[0] == 0.0 and values[-1] == 1.0
    assert values == sorted(values), values
    assert len(set(values)) >= 8, "encoding, each denoising step, decoding and muxing each move the bar"
    assert client.job(job.job_id).progress == 1.0
    assert {j.job_id: j.progress for j in client.stub.ListJobs(S.ListJobsRequest(page_size=1000)).jobs}[
        job.job_id
    ] == 1.0


def pages(client, by_job_id: bool, oldest_first: bool) -> list[list[str]]:
    """A whole listing in pages of 2, continued by next_page_token or by the last job id of each page."""
    result, cursor = [], {}
    while True:
        page = client.stub.ListJobs(S.ListJobsRequest(page_size=2, oldest_first=oldest_first, **cursor))
        result.append([job.job_id for job in page.jobs])
        if not page.next_page_token:
            return result
        cursor = dict(after_job_id=page.jobs[-1].job_id) if by_job_id else dict(page_token=page.next_page_token)


def test_after_job_id_pages_like_the_page_token_in_both_orders(client):
    for i in range(3):  # at least three pages, whatever ran before; finished, to leave no load to later tests
        client.generate(S.GenerateRequest(prompt=f"paging {i}", seed=i, **SMALL))
    newest = pages(client, by_job_id=False, oldest_first=False)
    oldest = pages(client, by_job_id=False, oldest_first=True)
    assert len(newest) >= 3 and pages(client, by_job_id=True, oldest_first=False) == newest
    assert pages(client, by_job_id=True, oldest_first=True) == oldest
    flat = [job_id for page in newest for job_id in page]
    assert [job_id for page in oldest for job_id in page] == flat[::-1] == listed(client, oldest_first=True)
    assert listed(client, after_job_id=flat[1]) == flat[2:]
    assert listed(client, after_job_id=flat[1], oldest_first=True) == flat[:1]

    err = refused(client.stub.ListJobs, S.ListJobsRequest(after_job_id=flat[0], page_token="1"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("after_job_id")
