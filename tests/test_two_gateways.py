"""Two gateways, A and B, each on a host of its own, on one PostgreSQL on a third, the tiny model's services on a
fourth, nginx in front (tests/topology.py): any gateway finishes any job, exactly once.

- A DELETE on B's own door cancels the job A runs, held at a DiT step: one terminal `cancelled`, no step after it.
- An SSE stream opened on B's own door follows the job A runs live: every event once, in order, to the end.
- A SIGKILLed while its job is held at a DiT step: B takes the job over and finishes it; the client's SSE stream
  through nginx (round-robin: on A or B), broken with A, resumes on B with Last-Event-ID: no gap, no repeat.
- A SIGSTOPped past its lease, then its host cut off 5 s as it wakes: B finishes the job, A's writes under its stale
  fence are refused (the store holds one run's events after the takeover, one terminal event, one artifact).
- An Idempotency-Key sent to A's HTTP door, then to B's: one job, whose artifact B serves (the shared blob_dir).
- An asset uploaded to A serves a job submitted to B.
- A bounded load run on both gateways (bench/two_gateways.py, at a small size): none lost, none committed twice.
Counted per job from the store: events 1..N with no gap or repeat, one terminal event, one artifact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import time
import urllib.request
from collections.abc import Generator, Iterator

import pytest
import stores
from dit_holding import HELD, HOLD_STEP
from namespaces import Unavailable
from topology import NginxUnavailable, Topology, topology

from bench import two_gateways
from bench.media_files import image
from h3serve.client import GatewayClient
from h3serve.client.events import is_terminal
from h3serve.gateway.jobs.runner import CANCELLED_BY_CLIENT, LEASE_S, RENEWALS_PER_LEASE
from h3serve.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
TAKEOVER_S = 3 * (LEASE_S + LEASE_S / RENEWALS_PER_LEASE)  # a lease and a claim round (docs/storage.md), with room
PARTITION_S = 5.0  # how long the woken gateway's host is cut off
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def two(dit_hold, tiny_model_dir, tmp_path_factory) -> Iterator[Topology]:
    pytest.importorskip("psycopg", reason="the postgres extra (psycopg) is not installed")
    try:
        with topology(tmp_path_factory.mktemp("two-gateways"), tiny_model_dir) as made:
            yield made
    except (Unavailable, stores.PostgresUnavailable, NginxUnavailable) as exc:
        pytest.skip(str(exc))


def held(request_id: str) -> S.GenerateRequest:
    """A job that the armed hold keeps at its DiT step (dit_holding.HELD)."""
    return S.GenerateRequest(
        prompt="a fox on two hosts",
        height=HELD["height"],
        width=HELD["width"],
        params=common_pb2.GenerationParams(num_inference_steps=HELD["num_inference_steps"], seed=3),
        request_id=request_id,
    )


def stored(two: Topology, job_id: str) -> tuple[list[S.JobEvent], S.Job]:
    """The job's events and record, read from the store itself."""

    async def read(store):
        return await store.events(job_id), await store.get_job(job_id)

    return stores.Backend("postgresql", two.store_location()).run(read)


def committed_once(two: Topology, job_id: str) -> list[S.JobEvent]:
    """The job's stored events, after checking it ended once: seq 1..N with no gap or repeat, one terminal event (the
    last, `done`), one artifact; after the last `retrying` (the takeover) one run's denoise steps, each once, in
    order: a fenced-out gateway's late writes would add a step, a stage or a second end. Returns the events."""
    events, job = stored(two, job_id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1)) == list(range(1, job.last_event_seq + 1))
    assert [is_terminal(e) for e in events].count(True) == 1 and events[-1].HasField("done"), events[-1]
    assert job.state == S.JOB_STATE_SUCCEEDED
    assert list(job.artifacts) == [events[-1].done.video], job.artifacts  # one, the one its end names
    last_run = events[max((i for i, e in enumerate(events) if e.HasField("retrying")), default=0) :]
    steps = [e.denoising.step for e in last_run if e.HasField("denoising")]
    assert steps == list(range(1, len(steps) + 1)) and steps, steps
    return events


def sse(door: str, job_id: str, last_event_id: int = 0) -> Generator[tuple[int, str, dict], None, None]:
    """The job's SSE stream from an HTTP door (nginx or one gateway's) as (id, event, data), from after
    `last_event_id`, until it ends."""
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
    request = urllib.request.Request(f"http://{door}/v1/videos/{job_id}/events", headers=headers)
    fields: dict[str, str] = {}
    with NO_PROXY.open(request, timeout=TAKEOVER_S) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line and not line.startswith(":"):  # ":": a keep-alive comment
                key, _, value = line.partition(": ")
                fields[key] = value
            if line or not fields:  # a blank line ends a message (and a keep-alive, which is none)
                continue
            yield int(fields["id"]), fields["event"], json.loads(fields["data"])
            fields = {}


def until_retrying(two: Topology, job_id: str) -> None:
    """Until the store has the job's `retrying` event: another gateway has claimed it (its takeover's first write)."""
    deadline = time.monotonic() + TAKEOVER_S
    while not any(e.HasField("retrying") for e in stored(two, job_id)[0]):
        assert time.monotonic() < deadline, f"no gateway took {job_id} over in {TAKEOVER_S:.0f} s"
        time.sleep(0.5)


def test_a_delete_on_b_cancels_the_job_a_runs_within_one_step(two, dit_hold):
    with dit_hold.armed(), GatewayClient(two.a.address) as a:
        job = a.stub.Submit(held("cancelled-from-b"))  # A claims the job submitted to it, and runs it
        for event in a.stub.Watch(S.WatchRequest(job_id=job.job_id)):
            if dit_hold.holds(event):
                break  # A's DiT call waits at the hold: the cancel lands mid-denoise
        deleted = json.loads(http(two.b.http_address, f"/v1/videos/{job.job_id}", "DELETE"))  # once it has ended
    assert deleted == {"id": job.job_id, "object": "video.deleted", "deleted": True}
    events, ended = stored(two, job.job_id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [is_terminal(e) for e in events].count(True) == 1 and events[-1].HasField("cancelled"), events[-1]
    assert events[-1].cancelled.reason == CANCELLED_BY_CLIENT and ended.state == S.JOB_STATE_CANCELLED
    steps = [e.denoising.step for e in events if e.HasField("denoising")]
    assert steps == list(range(1, HOLD_STEP + 1)), "the DiT ran a step after the cancel"
    dit = [r for r in ended.stage_records if r.stage == "dit"]
    assert [r.error for r in dit] == [CANCELLED_BY_CLIENT], "A's own task stopped its DiT call"


def test_an_sse_stream_opened_on_b_follows_the_job_a_runs_live(two, dit_hold):
    seen: list[tuple[int, str, dict]] = []
    with dit_hold.armed():
        with GatewayClient(two.a.address) as a:
            job = a.stub.Submit(held("followed-on-b"))
        for message in sse(two.b.http_address, job.job_id):  # B's own door, not nginx
            seen.append(message)
            if message[1] == "denoising" and message[2]["denoising"]["step"] == HOLD_STEP:
                dit_hold.release()  # A's job goes on only now: every later event is made after B's stream saw this
    events = committed_once(two, job.job_id)
    assert [message[0] for message in seen] == [e.seq for e in events], "B's stream missed or repeated an event"
    assert [kind for _, kind, _ in seen] == [e.WhichOneof("kind") for e in events]
    held_at = next(i for i, e in enumerate(events) if dit_hold.holds(e))
    assert [e.denoising.step for e in events[held_at + 1 :] if e.HasField("denoising")], "no step came after the hold"
    assert seen[-1][1] == "done"


def test_a_killed_gateways_job_is_finished_by_the_other_and_its_sse_stream_resumes_through_nginx(two, dit_hold):
    with GatewayClient(two.a.address) as a:
        job = a.stub.Submit(held("killed-gateway"))
    first: list[tuple[int, str, dict]] = []
    try:
        with dit_hold.armed(), contextlib.closing(sse(two.http, job.job_id)) as stream:  # to A or B
            for message in stream:
                first.append(message)
                if message[1] == "denoising" and message[2]["denoising"]["step"] == HOLD_STEP:
                    break  # held there: the client goes away, then A dies mid-denoise
            stream.close()
            two.a.kill()
        resumed = list(sse(two.http, job.job_id, last_event_id=first[-1][0]))  # A refuses: nginx tries B
    finally:
        two.a.start()
    seen = [message[0] for message in first + resumed]
    events = committed_once(two, job.job_id)
    assert seen == [e.seq for e in events], "the stream missed or repeated an event"
    assert [kind for _, kind, _ in first + resumed] == [e.WhichOneof("kind") for e in events]
    takeover = events[len(first)]  # B's first write: the job runs again, spending no attempt
    assert takeover.HasField("retrying") and takeover.retrying.attempt == 1, takeover
    assert resumed[-1][1] == "done"
    content = http(two.http, f"/v1/videos/{job.job_id}/content")  # from A, back up, or B: B's artifact
    assert hashlib.sha256(content).hexdigest() == events[-1].done.video.sha256


def test_a_gateway_stopped_past_its_lease_and_cut_off_writes_nothing_under_its_stale_fence(two, dit_hold):
    with GatewayClient(two.a.address) as a:
        job = a.stub.Submit(held("stopped-gateway"))
        with dit_hold.armed():
            for event in a.stub.Watch(S.WatchRequest(job_id=job.job_id)):
                if dit_hold.holds(event):
                    break
            two.a.signal(signal.SIGSTOP)
            try:
                until_retrying(two, job.job_id)  # B has it; A's DiT call is still held
            finally:
                with two.a.cut_off():
                    two.a.signal(signal.SIGCONT)  # A wakes cut off: its renewal and writes wait on the store
                    time.sleep(PARTITION_S)
    with GatewayClient(two.b.address) as b:
        assert list(b.events(job.job_id))[-1].HasField("done")
    # A tried to write about the job again, and was refused: its lease is no longer the job's.
    two.a.until_logged(rf"job {job.job_id}: lease \d+ of {two.a.gateway_id} is no longer the job's", TAKEOVER_S)
    committed_once(two, job.job_id)


def http(door: str, path: str, method: str = "GET") -> bytes:
    """The body of a request to an HTTP door (nginx or one gateway's)."""
    with NO_PROXY.open(urllib.request.Request(f"http://{door}{path}", method=method), timeout=60) as response:
        return response.read()


def create_video(door: str, key: str) -> dict:
    """POST /v1/videos to one gateway's HTTP door with an Idempotency-Key; the video object."""
    body = json.dumps({"prompt": "one key, two gateways", "size": "64x32", "steps": 2, "seed": 4}).encode()
    headers = {"content-type": "application/json", "Idempotency-Key": key}
    request = urllib.request.Request(f"http://{door}/v1/videos", data=body, headers=headers)
    with NO_PROXY.open(request, timeout=60) as response:
        return json.loads(response.read())


def test_one_idempotency_key_sent_to_a_then_b_makes_one_job_whose_artifact_b_serves(two, tmp_path):
    first, again = create_video(two.a.http_address, "a-then-b"), create_video(two.b.http_address, "a-then-b")
    assert again["id"] == first["id"]
    with GatewayClient(two.b.address) as b:
        listed = [j.job_id for j in b.stub.ListJobs(S.ListJobsRequest()).jobs if j.request_id == "a-then-b"]
    assert listed == [first["id"]]
    with GatewayClient(two.b.address) as b:  # B follows A's job live
        assert is_terminal(list(b.events(first["id"]))[-1])
    video = committed_once(two, first["id"])[-1].done.video
    with GatewayClient(two.b.address) as b:  # A's artifact, from B
        downloaded = b.download(video.artifact_id, tmp_path / video.file_name)
    assert hashlib.sha256(downloaded.read_bytes()).hexdigest() == video.sha256


def test_an_asset_uploaded_to_a_serves_a_job_submitted_to_b(two, tmp_path):
    with GatewayClient(two.a.address) as a:
        picture = a.upload(image(tmp_path / "picture.png", 48, 32, seed=5)).asset_id
    request = S.GenerateRequest(prompt="<Picture 1> on two hosts", height=32, width=64)
    request.params.num_inference_steps = 2
    request.references.add(asset_id=picture)
    with GatewayClient(two.b.address) as b:
        job = b.submit(request)
        assert list(b.events(job.job_id))[-1].HasField("done")
    assert stored(two, job.job_id)[1].request.references[0].asset_id == picture
    committed_once(two, job.job_id)


def test_a_small_load_run_on_both_gateways_loses_nothing_and_commits_each_job_once(two):
    counts = two_gateways.load(
        [two.a.address, two.b.address], two.store_location(), jobs=12, clients=4, steps=2, tag="test"
    )
    assert counts == two_gateways.LoadCounts(submitted=12, succeeded=12, lost=0, double_commits=0), counts
