"""The HTTP door through the real stack: the real `openai` SDK on /v1/videos, Server-Sent Events resumed after a
disconnect, asset uploads, and every refusal as OpenAI's error JSON with the gateway's reason."""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import signal
import ssl
import time
import urllib.error
import urllib.request
import warnings

import av
import grpc
import openai
import pytest
from deployments import write_config
from PIL import Image

from h3serve.cli.launcher import ServiceGroup, is_answering
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.server import GRACE_SECONDS
from h3serve.gateway.http.app import max_body_bytes
from h3serve.gateway.jobs.progress import advance
from h3serve.v1 import gateway_pb2

pytestmark = [pytest.mark.gateway, pytest.mark.processes]
warnings.filterwarnings("ignore", category=DeprecationWarning, module="openai")  # its Sora deprecation notes
SMALL = {"size": "64x32", "extra_body": {"steps": 4, "seed": 5}}
SLOW = {"size": "64x32", "extra_body": {"steps": 60, "seed": 6}}  # long enough to act on while it runs


@pytest.fixture()
def sdk(stack):
    client = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def grpc_events(stack, job_id: str) -> list[gateway_pb2.JobEvent]:
    from h3serve.client import GatewayClient

    with GatewayClient(stack.address("gateway")) as client:
        return list(client.stub.Watch(gateway_pb2.WatchRequest(job_id=job_id)))


def sse(url: str, last_event_id: int | None = None, stop_after: int | None = None) -> list[dict]:
    """The stream's messages as {"id", "event", "data"}; disconnects after `stop_after` of them."""
    request = urllib.request.Request(url, headers={"Last-Event-ID": str(last_event_id)} if last_event_id else {})
    messages, fields = [], {}
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith(":"):
                continue
            if line:
                key, _, value = line.partition(": ")
                fields[key] = value
                continue
            messages.append({"id": int(fields["id"]), "event": fields["event"], "data": json.loads(fields["data"])})
            fields = {}
            if stop_after and len(messages) == stop_after:
                break
    return messages


def http_error(url: str, data: bytes | None = None, method: str = "GET", headers: dict | None = None):
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers or {}))
    return caught.value.code, json.loads(caught.value.read())["error"]


def png(width: int = 96, height: int = 64) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_openai_sdk_creates_polls_downloads_and_lists(stack, sdk):
    video = sdk.videos.create(prompt="a red fox trotting through fresh snow", **SMALL)
    assert video.status in ("queued", "in_progress") and video.model == "minimax-h3"
    assert (video.size, video.seconds, video.h3serve["steps"], video.h3serve["seed"]) == ("64x32", "5.17", 4, 5)
    assert (video.h3serve["flow_shift"], video.h3serve["audio_flow_shift"], video.h3serve["adapters"]) == (12, 3, [])
    done = sdk.videos.poll(video.id, poll_interval_ms=200)
    assert (done.status, done.progress, done.error) == ("completed", 100, None)
    assert done.completed_at >= done.created_at
    assert done.expires_at - done.completed_at in (7 * 24 * 3600, 7 * 24 * 3600 + 1)  # the retention's 7 days
    content = sdk.videos.download_content(done.id)
    assert content.response.headers["content-disposition"] == f'attachment; filename="h3-{done.id}.mp4"'
    assert content.response.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(content.content)) as container:
        kinds = sorted(stream.type for stream in container.streams)
        frames = sum(1 for _ in container.decode(video=0))
    assert kinds == ["audio", "video"] and frames == 124
    job = next(e for e in grpc_events(stack, done.id) if e.HasField("done"))
    assert len(content.content) == job.done.video.bytes
    assert hashlib.sha256(content.content).hexdigest() == job.done.video.sha256
    listed = sdk.videos.list(limit=100)
    assert done.id in [item.id for item in listed.data]


def test_the_model_list_names_the_one_model_and_the_adapters_its_dit_loads(sdk):
    (model,) = sdk.models.list().data
    assert (model.id, model.object, model.model_extra["h3serve"]["adapters"]) == ("minimax-h3", "model", [])


def test_shifts_and_adapters_reach_the_request(stack, sdk):
    """A multipart form (the SDK's way) with the shifts; an adapter the DiT does not load is refused by name."""
    video = sdk.videos.create(
        prompt="a slow pan over a harbour",
        size="64x32",
        extra_body={"steps": 4, "flow_shift": 6, "audio_flow_shift": 2.5},
    )
    assert (video.h3serve["flow_shift"], video.h3serve["audio_flow_shift"]) == (6, 2.5)
    with pytest.raises(openai.BadRequestError, match="turbo4") as caught:
        sdk.videos.create(prompt="a slow pan", size="64x32", extra_body={"adapters": "turbo4:0.8,style"})
    assert "this DiT loads none" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # JSON: objects inside lists
        sdk.post(
            "/videos",
            cast_to=openai.types.Video,
            body={"prompt": "a slow pan", "adapters": [{"name": "a", "strength": 1}]},
        )
    assert caught.value.body["param"] == "adapters.0.strength"
    assert sdk.videos.poll(video.id, poll_interval_ms=200).status == "completed"


def test_paging_follows_after_and_order(stack, sdk):
    ids = [sdk.videos.create(prompt=f"paging clip {i}", **SMALL).id for i in range(3)]
    for video_id in ids:
        sdk.videos.poll(video_id, poll_interval_ms=200)
    newest = [item.id for item in sdk.videos.list(limit=100).data]
    assert newest[:3] == ids[::-1]
    page = sdk.videos.list(limit=1)
    assert page.has_more and page.data[0].id == ids[-1]
    walked = [item.id for item in sdk.videos.list(limit=1)]  # iterating a page follows `after`
    assert walked == newest
    oldest = [item.id for item in sdk.videos.list(limit=2, order="asc")]
    assert oldest == newest[::-1]


def test_delete_cancels_a_running_job_into_the_bin_and_restore_brings_it_back(stack, sdk):
    video = sdk.videos.create(prompt="a lighthouse beam sweeping a storm", **SLOW)
    sse(f"{stack.http}/v1/videos/{video.id}/events", stop_after=3)  # accepted, encoding, a first step
    deleted = sdk.videos.delete(video.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (video.id, "video.deleted", True)
    events = grpc_events(stack, video.id)
    assert events[-1].HasField("cancelled") and not any(e.HasField("done") for e in events)
    gone = sdk.videos.retrieve(video.id)
    assert gone.status == "cancelled" and gone.deleted_at >= gone.created_at
    assert video.id not in [item.id for item in sdk.videos.list(limit=100).data]
    assert video.id in [item.id for item in sdk.videos.list(limit=100, extra_query={"deleted": "true"}).data]
    restored = sdk.post(f"/videos/{video.id}/restore", cast_to=openai.types.Video)
    assert restored.status == "cancelled" and restored.deleted_at is None
    assert video.id in [item.id for item in sdk.videos.list(limit=100).data]
    with pytest.raises(openai.NotFoundError, match="completed"):
        sdk.videos.download_content(video.id)


def test_cancel_keeps_the_video_listed(stack, sdk):
    video = sdk.videos.create(prompt="a paper boat drifting down a gutter", **SLOW)
    cancelled = sdk.post(f"/videos/{video.id}/cancel", cast_to=openai.types.Video)
    assert cancelled.status == "cancelled" and cancelled.deleted_at is None
    assert video.id in [item.id for item in sdk.videos.list(limit=100).data]


def test_the_same_idempotency_key_is_one_job(stack, sdk):
    key = {"Idempotency-Key": "http-door-once-1"}
    first = sdk.videos.create(prompt="one job only", extra_headers=key, **SMALL)
    again = sdk.videos.create(prompt="one job only", extra_headers=key, **SMALL)
    assert again.id == first.id and again.h3serve["request_id"] == "http-door-once-1"
    with pytest.raises(openai.ConflictError, match="different request") as caught:
        sdk.videos.create(prompt="another request", extra_headers=key, **SMALL)
    assert caught.value.response.headers["x-should-retry"] == "false"
    sdk.videos.poll(first.id, poll_interval_ms=200)


def test_input_reference_is_the_first_keyframe(stack, sdk):
    image = png()
    video = sdk.videos.create(
        prompt="<Picture 1> comes alive", input_reference=("key.png", image, "image/png"), **SMALL
    )
    assert video.h3serve["workflow"] == "fl2va"
    assert video.h3serve["first_frame"] == hashlib.sha256(image).hexdigest()
    assert sdk.videos.poll(video.id, poll_interval_ms=200).status == "completed"


def test_events_resume_after_a_disconnect_without_gap_or_repeat(stack, sdk):
    video = sdk.videos.create(prompt="a hummingbird at a feeder", size="64x32", extra_body={"steps": 8, "seed": 9})
    url = f"{stack.http}/v1/videos/{video.id}/events"
    head = sse(url, stop_after=4)
    tail = sse(url, last_event_id=head[-1]["id"])
    seen = head + tail
    stored = grpc_events(stack, video.id)
    assert [m["id"] for m in seen] == [e.seq for e in stored] == list(range(1, len(stored) + 1))
    assert [m["event"] for m in seen] == [e.WhichOneof("kind") for e in stored]
    assert seen[-1]["event"] == "done" and seen[-1]["data"]["done"]["video"]["file_name"] == f"h3-{video.id}.mp4"
    progress, expected = 0.0, []
    for event in stored:
        progress = advance(progress, event)
        expected.append(round(100 * progress))
    assert [m["data"]["progress"] for m in seen] == expected
    assert expected == sorted(expected) and expected[-1] == 100
    steps = [m["data"]["denoising"] for m in seen if m["event"] == "denoising"]
    assert [(s["step"], s["total"]) for s in steps] == [(i, 7) for i in range(1, 8)]
    assert sse(url, last_event_id=len(stored)) == []  # nothing after the terminal event


def test_json_requests_name_their_references(stack, sdk):
    """curl's way in: JSON, with an uploaded asset as a ref2va reference."""
    upload = urllib.request.Request(
        f"{stack.http}/v1/assets",
        data=_multipart("file", "ref.png", png(64, 64)),
        headers={"content-type": f"multipart/form-data; boundary={BOUNDARY}"},
    )
    asset = json.load(urllib.request.urlopen(upload))
    assert (asset["object"], asset["kind"], asset["format"], asset["width"]) == ("asset", "image", "png", 64)
    body = {
        "prompt": "<Picture 1> in a meadow",
        "size": "64x32",
        "steps": 4,
        "references": [{"asset_id": asset["id"], "kind": "image"}],
    }
    created = json.load(
        urllib.request.urlopen(
            urllib.request.Request(
                f"{stack.http}/v1/videos", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
            )
        )
    )
    assert created["h3serve"]["workflow"] == "ref2va"
    assert created["h3serve"]["references"] == [{"asset_id": asset["id"], "kind": "image", "label": "<Picture 1>"}]
    assert sdk.videos.poll(created["id"], poll_interval_ms=200).status == "completed"


BOUNDARY = "h3serve-test-boundary"


def _multipart(field: str, name: str, data: bytes) -> bytes:
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{field}"; filename="{name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


@pytest.mark.parametrize(
    "kwargs, status, param, reason",
    [
        (dict(seconds="4"), 400, None, "seconds: must be between 5 and 14.375"),
        (dict(size="big"), 400, "size", "size: width x height in pixels"),
        (dict(size="64x30"), 400, None, "multiple"),
        (dict(model="sora-2"), 400, "model", "serves 'minimax-h3'"),
        (dict(extra_body={"colour": "red"}), 400, "colour", "colour: Extra inputs are not permitted"),
        (dict(extra_body={"steps": 100000}), 400, None, "num_inference_steps"),
        (dict(extra_body={"workflow": "t2v"}), 400, "workflow", "workflow:"),
        (dict(input_reference=("notes.txt", b"not an image", "text/plain")), 400, None, "notes.txt"),
        (dict(extra_body={"adapters": ["turbo4:0.8"]}), 400, None, "turbo4"),
        (dict(extra_body={"flow_shift": 500}), 400, None, "flow_shift"),
        (dict(extra_body={"references": "[not json"}), 400, "references", "references:"),
    ],
)
def test_bad_requests_are_4xx_with_the_reason(stack, sdk, kwargs, status, param, reason):
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.videos.create(prompt="a refused clip", **kwargs)
    error = caught.value
    assert error.status_code == status and reason in error.body["message"]
    assert error.body["param"] == param and error.body["type"] == "invalid_request_error"


def test_unknown_ids_and_unfinished_content_are_404(stack, sdk):
    with pytest.raises(openai.NotFoundError, match="no job"):
        sdk.videos.retrieve("no-such-video")
    with pytest.raises(openai.NotFoundError, match="no job"):
        sdk.videos.delete("no-such-video")
    assert http_error(f"{stack.http}/v1/videos/no-such-video/events")[0] == 404
    code, error = http_error(f"{stack.http}/v1/videos/no-such-video/content")
    assert code == 404 and error["code"] == "not_found"
    assert http_error(f"{stack.http}/v1/videos?limit=0")[1]["param"] == "limit"
    assert http_error(f"{stack.http}/v1/videos?order=up")[1]["param"] == "order"
    code, error = http_error(
        f"{stack.http}/v1/assets", data=b"{}", method="POST", headers={"content-type": "application/json"}
    )
    assert code == 400 and error["param"] == "file"
    code, error = http_error(
        f"{stack.http}/v1/videos", data=b"not json", method="POST", headers={"content-type": "application/json"}
    )
    assert code == 400 and "not JSON" in error["message"]


def test_health_and_the_console_page(stack):
    assert json.load(urllib.request.urlopen(f"{stack.http}/healthz")) == {"serving": True}
    for path in ("/", "/console/console.js", "/console/console.css"):
        with urllib.request.urlopen(f"{stack.http}{path}") as response:
            assert response.headers["cache-control"] == "no-cache" and response.read()
    page = urllib.request.urlopen(f"{stack.http}/").read().decode()
    assert "<html" in page.lower() and "h3serve" in page


@pytest.fixture(scope="module")
def locked_gateway(tmp_path_factory, tiny_model_dir, certificate):
    """A gateway alone (its stages down) with a bearer token and TLS on both doors."""
    root = tmp_path_factory.mktemp("locked")
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway", "http")}
    cert, key = certificate
    path = write_config(
        root / "deploy.toml",
        str(tiny_model_dir),
        root / "gateway",
        ports,
        auth_token="s3cret",
        tls_cert=str(cert),
        tls_key=str(key),
        http_port=ports["http"],
    )
    with ServiceGroup(load_deploy(path), str(path), log_dir=str(root), names=("gateway",), ready=is_answering):
        yield f"https://127.0.0.1:{ports['http']}/v1", cert


def test_the_bearer_token_and_tls_are_the_grpc_doors(locked_gateway):
    url, cert = locked_gateway

    def client(token: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=url, api_key=token, max_retries=0, http_client=openai.DefaultHttpxClient(verify=str(cert))
        )

    with pytest.raises(openai.AuthenticationError) as caught:
        client("wrong").videos.list()
    assert caught.value.body["code"] == grpc.StatusCode.UNAUTHENTICATED.name.lower()
    with pytest.raises(urllib.error.HTTPError) as caught:  # no token at all (the SDK always sends one)
        urllib.request.urlopen(f"{url}/videos", context=ssl.create_default_context(cafile=str(cert)))
    assert caught.value.code == 401 and json.loads(caught.value.read())["error"]["type"] == "authentication_error"
    assert client("s3cret").videos.list().data == []
    with pytest.raises(openai.NotFoundError):
        client("s3cret").videos.retrieve("nothing-here")
    with pytest.raises(openai.APIConnectionError):  # TLS only: plaintext HTTP is not answered
        openai.OpenAI(base_url=url.replace("https", "http"), api_key="s3cret", max_retries=0).videos.list()


def test_a_gateway_stop_ends_open_event_streams(tmp_path, tiny_model_dir):
    """SIGTERM with a client on a job's event stream: the stream ends, the gateway exits 0 within its grace."""
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway", "http")}
    path = write_config(
        tmp_path / "deploy.toml", str(tiny_model_dir), tmp_path / "gateway", ports, http_port=ports["http"]
    )
    group = ServiceGroup(load_deploy(path), str(path), log_dir=str(tmp_path), names=("gateway",), ready=is_answering)
    with group:
        base = f"http://127.0.0.1:{ports['http']}/v1"
        video = json.load(
            urllib.request.urlopen(
                urllib.request.Request(  # queues: its stages are down
                    f"{base}/videos",
                    data=b'{"prompt": "waits for its stages"}',
                    headers={"content-type": "application/json"},
                )
            )
        )
        stream = urllib.request.urlopen(f"{base}/videos/{video['id']}/events", timeout=60)
        assert stream.readline().decode().startswith("id: 1")
        gateway = group.running[0].process
        gateway.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert stream.read().decode().endswith("\n")  # the rest arrives and the stream closes: no hang
        assert gateway.wait(timeout=30) == 0 and time.monotonic() - started < GRACE_SECONDS + 5


def test_a_body_over_the_upload_limit_is_refused_before_it_is_read(stack):
    connection = http.client.HTTPConnection(stack.http.removeprefix("http://"), timeout=30)
    for path in ("/v1/videos", "/v1/assets"):
        connection.putrequest("POST", path)
        connection.putheader("content-type", "multipart/form-data; boundary=x")
        connection.putheader("content-length", str(10**12))
        connection.endheaders()  # and no body: the answer must not wait for it
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 413 and "1,000,000,000,000 bytes" in error["message"]
        assert f"at most {max_body_bytes(load_deploy(stack.config_path).gateway):,}" in error["message"]
        connection.close()


# Sizes (issue 29): a request too large is the client's to fix, never a 429 with `x-should-retry: true` (the SDKs
# retried a 9 MB prompt for ever); only a full queue is worth a retry.


@pytest.fixture()
def counted_sdk(stack):
    """An SDK that would retry three times, and the list of the requests it actually sent."""
    sent = []
    client = openai.OpenAI(
        base_url=f"{stack.http}/v1",
        api_key="unused",
        max_retries=3,
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [sent.append]}),
    )
    yield client, sent
    client.close()


def test_a_9_mb_prompt_is_a_400_on_the_prompt_and_never_retried(stack, counted_sdk):
    sdk, sent = counted_sdk
    prompt = "a fox " * 1_500_000  # 9 MB: over the API's 4 MiB message limit
    with pytest.raises(openai.BadRequestError) as caught:  # the SDK's multipart form
        sdk.videos.create(prompt=prompt, size="64x32")
    assert caught.value.response.headers["x-should-retry"] == "false" and len(sent) == 1
    assert caught.value.body == {
        "message": f"prompt: at most 8192 characters, got {len(prompt)}",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "invalid_argument",
    }
    with pytest.raises(openai.BadRequestError) as caught:  # JSON
        sdk.post("/videos", cast_to=openai.types.Video, body={"prompt": prompt})
    assert caught.value.body["param"] == "prompt" and len(sent) == 2


def test_an_oversized_id_field_is_a_400_naming_it_and_never_retried(stack, counted_sdk):
    sdk, sent = counted_sdk
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.post("/videos", cast_to=openai.types.Video, body={"prompt": "a fox", "first_frame": "f" * (5 << 20)})
    assert caught.value.body["param"] == "first_frame" and "(max_request_bytes)" in caught.value.body["message"]
    assert caught.value.response.headers["x-should-retry"] == "false" and len(sent) == 1


def test_a_form_field_over_the_door_limit_is_a_400_and_never_retried(stack, counted_sdk):
    sdk, sent = counted_sdk
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.videos.create(prompt="x" * (20 << 20), size="64x32")
    assert (
        caught.value.body["type"] == "invalid_request_error" and "a field takes at most" in caught.value.body["message"]
    )
    assert caught.value.response.headers["x-should-retry"] == "false" and len(sent) == 1


def test_a_framework_refusal_is_openais_error_json(stack):
    code, error = http_error(f"{stack.http}/v1/nowhere")
    assert code == 404 and error["type"] == "invalid_request_error"
    code, error = http_error(f"{stack.http}/v1/videos/x", method="PUT", data=b"")
    assert code == 405 and error["message"] == "Method Not Allowed"


@pytest.mark.parametrize(
    "code, message, status, kind, retry",
    [
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Received message larger than max (9000044 vs. 4194304)",
            413,
            "invalid_request_error",
            "false",
        ),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Sent message larger than max (9000044 vs. 4194304)",
            413,
            "invalid_request_error",
            "false",
        ),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "the job queue is full: 8 unfinished jobs, the bound is 8; retry later",
            429,
            "rate_limit_error",
            "true",
        ),
        (grpc.StatusCode.UNAVAILABLE, "no replica", 503, "server_error", "true"),
    ],
)
def test_too_large_and_too_many_map_apart(code, message, status, kind, retry):
    from h3serve.gateway.http.errors import error_response

    response = error_response(code, message)
    body = json.loads(response.body)["error"]
    assert (response.status_code, body["type"], response.headers["x-should-retry"]) == (status, kind, retry)
