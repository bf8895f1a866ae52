"""The jobs API through the real four-process stack: Submit, Watch, GetJob records, ListJobs, idempotency,
admission, Info and the Prometheus scrape."""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from h3serve.client import GatewayClient
from h3serve.v1 import common_pb2, dit_pb2_grpc, gateway_pb2

pytestmark = [pytest.mark.gateway, pytest.mark.processes]
SMALL = dict(height=32, width=64, num_inference_steps=8)
S = gateway_pb2


@pytest.fixture()
def client(stack):
    client = GatewayClient(stack.address("gateway"))
    yield client
    client.close()


def watch(client, job_id: str, after_seq: int = 0) -> list[gateway_pb2.JobEvent]:
    return list(client.stub.Watch(S.WatchRequest(job_id=job_id, after_seq=after_seq)))


def test_submit_returns_a_durable_job_and_get_job_records_every_stage(stack, client):
    prompt = "a heron lifting off a misty pond"
    job = client.stub.Submit(S.GenerateRequest(prompt=prompt, seed=21, **SMALL))
    assert job.state in (S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING) and job.request.seed == 21
    events = watch(client, job.job_id)
    assert events[0].HasField("accepted") and events[-1].HasField("done")
    assert [e.log_seq for e in events] == sorted(e.log_seq for e in events)
    done = client.job(job.job_id)
    assert done.state == S.JOB_STATE_SUCCEEDED and done.attempts == 1
    records = {r.stage: r for r in done.stage_records}
    assert list(records) == ["encoder", "dit", "vae"]
    for stage, name in (("encoder", "encoder"), ("dit", "dit"), ("vae", "vae")):
        record = records[stage]
        assert record.replica == stack.address(name) and record.tries == 1 and record.error == ""
        assert 0 < record.enqueued <= record.started <= record.finished
        assert record.bytes_in > 0 and record.bytes_out > 0
    assert records["encoder"].bytes_in == len(prompt.encode())
    assert records["encoder"].bytes_out == records["dit"].bytes_in, "the gateway relays the embeddings unchanged"
    assert records["dit"].bytes_out == records["vae"].bytes_in
    assert records["vae"].bytes_out == done.artifacts[0].bytes
    assert records["encoder"].finished <= records["dit"].started and records["dit"].finished <= records["vae"].started


def test_submit_is_idempotent_on_the_request_id(stack, client):
    dit = dit_pb2_grpc.DiTStub(grpc.insecure_channel(stack.address("dit")))
    before = dit.Info(common_pb2.InfoRequest()).requests_served
    request = S.GenerateRequest(prompt="one run only", seed=3, request_id="client-42/retry-safe", **SMALL)
    with ThreadPoolExecutor(4) as pool:  # four racing submits of the same request
        jobs = list(pool.map(lambda _: client.stub.Submit(request), range(4)))
    assert len({job.job_id for job in jobs}) == 1 and jobs[0].request_id == "client-42/retry-safe"
    final = client.generate(request)  # Generate with the same id attaches to the same job
    assert final.job_id == jobs[0].job_id and final.HasField("done")
    assert dit.Info(common_pb2.InfoRequest()).requests_served - before == 1, "exactly one DiT run"

    with pytest.raises(grpc.RpcError) as err:
        client.stub.Submit(S.GenerateRequest(prompt="something else", request_id="client-42/retry-safe", **SMALL))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and jobs[0].job_id in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Submit(S.GenerateRequest(prompt="x", request_id="has space", **SMALL))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("request_id:")


def test_watch_reattaches_after_the_client_disconnects(client):
    stream = client.stub.Generate(
        S.GenerateRequest(prompt="a long night train", seed=8, height=32, width=64, num_inference_steps=30)
    )
    seen = []
    for event in stream:
        seen.append(event)
        if event.HasField("denoising") and event.denoising.step == 3:
            break
    stream.cancel()  # the client goes away mid-denoise; the job does not
    rest = watch(client, seen[0].job_id, after_seq=seen[-1].seq)
    events = seen + rest
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), "no gap and no repeat across the re-attach"
    assert [e.denoising.step for e in events if e.HasField("denoising")] == list(range(1, 30))
    assert events[-1].HasField("done")
    assert watch(client, seen[0].job_id, after_seq=events[-2].seq) == [events[-1]], "a finished job replays its end"


def test_list_jobs_filters_by_state_and_pages(client):
    ids = [client.generate(S.GenerateRequest(prompt=f"listing {i}", seed=i, **SMALL)).job_id for i in range(3)]
    pages, token = [], ""
    while True:
        page = client.stub.ListJobs(S.ListJobsRequest(states=[S.JOB_STATE_SUCCEEDED], page_size=2, page_token=token))
        assert len(page.jobs) <= 2
        pages.append(page.jobs)
        token = page.next_page_token
        if not token:
            break
    listed = [job.job_id for jobs in pages for job in jobs]
    assert len(listed) == len(set(listed)) and listed[:3] == ids[::-1], "newest first, each once"
    assert all(job.state == S.JOB_STATE_SUCCEEDED and not job.stage_records for jobs in pages for job in jobs)
    cancelled = client.stub.ListJobs(S.ListJobsRequest(states=[S.JOB_STATE_CANCELLED], page_size=1000))
    assert all(job.state == S.JOB_STATE_CANCELLED for job in cancelled.jobs)
    for bad, field in (
        (dict(page_size=1001), "page_size"),
        (dict(page_size=-1), "page_size"),
        (dict(states=[99]), "states"),
        (dict(page_token="abc"), "page_token"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            client.stub.ListJobs(S.ListJobsRequest(**bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)


def test_admission_refuses_over_capacity_with_the_ceiling(client):
    # deployments.STACK_CAPACITY: t2va 512x512 takes 20000 rows. 260 frames need 20,579 (77 latent frames x 256
    # rows + 2 x 433 audio + 1 text), 243 frames 19,243.
    before = client.stub.ListJobs(S.ListJobsRequest(page_size=1000))
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Submit(S.GenerateRequest(prompt="a", height=512, width=512, num_frames=260))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(
        "num_frames: 512x512 allows at most 243 frames here: 260 frames need 20,579 packed rows"
    ), err.value.details()
    assert client.stub.ListJobs(S.ListJobsRequest(page_size=1000)) == before, "nothing was written"


def test_info_reports_each_stage(stack, client):
    before = {stage.stage: stage.replicas[0].calls for stage in client.stub.Info(common_pb2.InfoRequest()).stages}
    client.generate(S.GenerateRequest(prompt="info probe", seed=1, **SMALL))
    info = client.stub.Info(common_pb2.InfoRequest())
    assert info.serving and info.max_unfinished_jobs == 64
    assert [s.stage for s in info.stages] == ["encoder", "vae-encode", "dit", "vae"]
    for stage in info.stages:
        replica = stack.address("vae" if stage.stage == "vae-encode" else stage.stage)
        assert stage.workers == 1 and stage.queue_depth == 0
        assert [(r.address, r.healthy) for r in stage.replicas] == [(replica, True)]
        # vae-encode runs on the VAE replica but counts its own calls: a t2va job makes none (other tests' fl2va
        # and ref2va jobs on this shared stack do).
        calls = stage.replicas[0].calls - before[stage.stage]
        assert (calls == 0) == (stage.stage == "vae-encode"), stage
    assert 0.0 <= info.stages[0].cache_hit_rate <= 1.0


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_scrape_has_the_named_series(stack, client):
    before = scrape(stack.ports["metrics"])
    prompt = "metrics: a cat on a warm stove"
    client.generate(S.GenerateRequest(prompt=prompt, seed=1, **SMALL))
    client.generate(S.GenerateRequest(prompt=prompt, seed=2, **SMALL))
    after = scrape(stack.ports["metrics"])

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("h3serve_embedding_cache_total", result="miss") >= 1
    assert grew("h3serve_embedding_cache_total", result="hit") >= 1
    assert grew("h3serve_denoise_step_seconds_count") == 2 * 7
    assert grew("h3serve_stage_seconds_count", stage="vae") == 2
    assert grew("h3serve_tensor_bytes_total", stage="dit", direction="out") > 0
    assert after[("h3serve_jobs", (("state", "succeeded"),))] >= 2
    for stage in ("encoder", "dit", "vae"):
        assert ("h3serve_stage_queue_depth", (("stage", stage),)) in after
        assert ("h3serve_stage_retries_total", (("stage", stage),)) in after


def test_stages_overlap_across_three_jobs(stack, client):
    """While the DiT denoises job 2, the VAE holds job 1 and the encoder encodes job 3: proven by the order of the
    events in the gateway-wide log (log_seq), which one stage at a time could never produce. Speed cannot decide
    the order: the VAE is stopped (SIGSTOP) until job 2 denoises, the DiT until job 3 is encoded."""
    vae = [next(item.process.pid for item in stack.group.running if item.name == "vae")]
    with grpc.insecure_channel(stack.address("dit")) as channel:
        dit = [r.pid for r in dit_pb2_grpc.DiTStub(channel).Info(common_pb2.InfoRequest(), timeout=10).ranks]
    with stopped(vae):
        first = client.stub.Submit(S.GenerateRequest(prompt="overlap one", seed=1, **SMALL))
        second = client.stub.Submit(
            S.GenerateRequest(prompt="overlap two", seed=2, height=128, width=224, num_inference_steps=40)
        )
        first_event(client, second.job_id, "denoising")  # job 1 cannot have finished: its decode is held
        with stopped(dit):
            third = client.stub.Submit(S.GenerateRequest(prompt="overlap three", seed=3, **SMALL))
            first_event(client, third.job_id, "encoding")  # job 2 cannot have finished: its denoise is held
    one, two, three = (watch(client, job.job_id) for job in (first, second, third))
    assert all(events[-1].HasField("done") for events in (one, two, three))

    def seqs(events, *kinds):
        return [e.log_seq for e in events if e.WhichOneof("kind") in kinds]

    two_steps = seqs(two, "denoising")
    assert seqs(one, "denoising")[-1] < two_steps[0] < seqs(one, "done")[0], "job 1 decoded while job 2 denoised"
    assert two_steps[0] < seqs(three, "encoding")[0] < two_steps[-1], "job 3 encoded while job 2 denoised"
    assert seqs(three, "denoising")[0] > two_steps[-1], "one DiT replica: job 3 denoises after job 2"


@contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def first_event(client, job_id: str, kind: str) -> gateway_pb2.JobEvent:
    stream = client.stub.Watch(S.WatchRequest(job_id=job_id))
    try:
        return next(e for e in stream if e.WhichOneof("kind") == kind)
    finally:
        stream.cancel()
