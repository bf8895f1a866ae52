"""End to end through the real gateway, encoder, DiT and VAE processes on loopback."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from dit_holding import HELD
from forked import run_forked

from h3serve.cli.reference import ReferenceRequest, base_params, run_reference
from h3serve.client import GatewayClient
from h3serve.runtime.models import ModelSource
from h3serve.v1 import common_pb2, dit_pb2, dit_pb2_grpc, encoder_pb2_grpc, gateway_pb2

pytestmark = pytest.mark.processes

PROMPT = "a paper boat drifting down a rain gutter"
SMALL = dict(prompt=PROMPT, height=32, width=64, num_frames=124, num_inference_steps=8)


@pytest.fixture()
def client(stack):
    client = GatewayClient(stack.address("gateway"))
    yield client
    client.close()


def run(client, **fields):
    events = []
    final = client.generate(gateway_pb2.GenerateRequest(**fields), events.append)
    return final, events


@pytest.mark.fidelity
def test_gateway_output_is_bit_identical_to_diffusers(stack, client, fork_server, tmp_path):
    final, events = run(client, **SMALL, seed=1234, include_raw=True)
    assert final.WhichOneof("kind") == "done", final
    served = np.load(client.download(final.done.raw.artifact_id, tmp_path / "served.npz"))

    # diffusers' own monolithic MiniMaxH3Blocks on the tiny preset built in this process (the
    # services loaded the same weights back from the saved model directory).
    expected = run_reference(ModelSource(None), ReferenceRequest(PROMPT, 32, 64, 124, base_params(8, 1234)))
    assert served["frames"].shape == (124, 32, 64, 3) and served["audio"].shape == (2, 165600)
    assert np.array_equal(served["frames"], expected["frames"])
    assert np.array_equal(served["audio"], expected["audio"])
    accepted = events[0].accepted.request
    assert (accepted.text_rows, accepted.total_rows) == (int(expected["text_rows"]), int(expected["packed_rows"]))

    cli_out = tmp_path / "reference.npz"
    run_forked(  # the CLI as a fork of the session's fork server: its imports done
        fork_server,
        [
            sys.executable,
            "-m",
            "h3serve.cli",
            "reference",
            "--model-dir",
            str(stack.model_dir),
            "--prompt",
            PROMPT,
            "--height",
            "32",
            "--width",
            "64",
            "--steps",
            "8",
            "--seed",
            "1234",
            "--raw",
            str(cli_out),
        ],
    )
    reference = np.load(cli_out)
    assert np.array_equal(reference["frames"], served["frames"])
    assert np.array_equal(reference["audio"], served["audio"])


def test_events_arrive_in_order_and_the_mp4_downloads(client, tmp_path):
    final, events = run(client, **SMALL, seed=5)
    kinds = [e.WhichOneof("kind") for e in events]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert kinds[:2] == ["accepted", "encoding"] and kinds[-1] == "done"
    steps = [e.denoising.step for e in events if e.HasField("denoising")]
    assert steps == list(range(1, 8)), "N=8 gives exactly N-1 = 7 denoise steps, in order"
    first_decode = kinds.index("decoding")
    assert kinds[2:first_decode] == ["denoising"] * 7
    decoding = [e.decoding for e in events if e.HasField("decoding")]
    assert [d.chunk for d in decoding] == list(range(1, decoding[-1].total + 1))
    assert kinds.index("muxing") > kinds.index("decoding")

    path = client.download(final.done.video.artifact_id, tmp_path / "out.mp4")
    assert final.done.video.file_name == f"h3-{final.job_id}.mp4"
    import hashlib

    assert hashlib.sha256(path.read_bytes()).hexdigest() == final.done.video.sha256
    import av

    with av.open(str(path)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, float(video.average_rate), video.frames) == ("h264", 24.0, 124)
        assert (audio.codec_context.name, audio.codec_context.sample_rate, audio.codec_context.channels) == (
            "aac",
            32000,
            2,
        )
    job = client.job(final.job_id)
    assert job.state == gateway_pb2.JOB_STATE_SUCCEEDED
    assert [s.stage for s in job.stages] == ["encode", "denoise", "decode", "mux"]


def test_repeated_prompt_hits_the_cache_and_runs_no_model(stack, client):
    encoder = encoder_pb2_grpc.EncoderStub(grpc.insecure_channel(stack.address("encoder")))
    prompt = "a lighthouse in a storm, cache probe"
    first, events_a = run(client, **{**SMALL, "prompt": prompt}, seed=1)
    runs_after_first = encoder.Info(common_pb2.InfoRequest()).model_runs
    second, events_b = run(client, **{**SMALL, "prompt": prompt}, seed=2)
    info = encoder.Info(common_pb2.InfoRequest())
    assert [e.encoding.cache_hit for e in events_a + events_b if e.HasField("encoding")] == [False, True]
    assert info.model_runs == runs_after_first
    assert info.cache_hits >= 1


def test_cancel_mid_denoise_stops_within_one_step(stack, client, dit_hold):
    dit = dit_pb2_grpc.DiTStub(grpc.insecure_channel(stack.address("dit")))
    before = dit.Info(common_pb2.InfoRequest()).steps_served
    request = gateway_pb2.GenerateRequest(prompt=PROMPT, **HELD, seed=3)
    events, cancelled = [], threading.Event()

    def on_event(event):
        events.append(event)
        if dit_hold.holds(event) and not cancelled.is_set():  # the DiT waits at this step: the cancel lands mid-run
            cancelled.set()
            job = client.stub.CancelJob(gateway_pb2.CancelJobRequest(job_id=event.job_id))
            assert job.state == gateway_pb2.JOB_STATE_CANCELLED

    with dit_hold.armed():
        final = client.generate(request, on_event)
    assert final.WhichOneof("kind") == "cancelled"
    last_step = max(e.denoising.step for e in events if e.HasField("denoising"))
    ran = dit.Info(common_pb2.InfoRequest()).steps_served - before
    total = request.num_inference_steps - 1  # step events of a job that runs to its end
    assert ran <= last_step + 1 < total, f"the DiT ran {ran} steps after the client saw {last_step}"
    job = client.job(final.job_id)
    assert job.state == gateway_pb2.JOB_STATE_CANCELLED
    assert [(r.stage, r.finished, r.error) for r in job.stage_records][-1] == ("dit", 0.0, "cancelled by CancelJob")
    after, _ = run(client, **SMALL, seed=4)
    assert after.WhichOneof("kind") == "done"


BAD_REQUESTS = [
    ("height", dict(height=40, width=64)),
    ("width", dict(height=32)),
    ("width", dict(height=32, width=32 * 5)),
    ("height", dict(height=1024, width=1344)),
    ("num_frames", dict(num_frames=120)),
    ("seconds", dict(seconds=20.0)),
    ("num_inference_steps", dict(num_inference_steps=1)),
    ("num_inference_steps", dict(num_inference_steps=100000)),
    ("first_frame", dict(workflow=common_pb2.WORKFLOW_FL2VA)),
    ("references", dict(workflow=common_pb2.WORKFLOW_REF2VA)),
    ("first_frame", dict(first_frame="f" * 64)),
]


@pytest.mark.parametrize("field,fields", BAD_REQUESTS)
def test_invalid_field_is_refused_with_its_name(client, field, fields):
    with pytest.raises(grpc.RpcError) as err:
        run(client, prompt=PROMPT, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()


@pytest.mark.parametrize("prompt", ["", "   ", "x" * 8193])
def test_empty_or_overlong_prompt_is_refused(client, prompt):
    with pytest.raises(grpc.RpcError) as err:
        run(client, prompt=prompt)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt:")


def test_unknown_job_and_artifact_are_not_found(client):
    with pytest.raises(grpc.RpcError) as err:
        client.job("nope")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        client.download("nope-video")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_dit_refuses_a_spec_the_model_rejects(stack):
    dit = dit_pb2_grpc.DiTStub(grpc.insecure_channel(stack.address("dit")))
    with pytest.raises(grpc.RpcError) as err:
        list(
            dit.Denoise(
                iter(
                    [
                        dit_pb2.DenoiseInput(
                            spec=dit_pb2.DenoiseSpec(
                                height=32,
                                width=64,
                                num_frames=124,
                                params=common_pb2.GenerationParams(num_inference_steps=2),
                            )
                        )
                    ]
                )
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_embeds" in err.value.details()


def test_cli_generate_with_a_request_id_runs_the_job_once(stack, client, tmp_path):
    import sys

    def generate(out: str) -> bytes:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "h3serve.cli",
                "generate",
                "--gateway",
                stack.address("gateway"),
                "--prompt",
                "the same request twice",
                "--steps",
                "3",
                "--height",
                "32",
                "--width",
                "64",
                "--seed",
                "4",
                "--request-id",
                "cli-retry-1",
                "--out",
                str(tmp_path / out),
            ],
            capture_output=True,
            check=True,
        )
        return (tmp_path / out).read_bytes()

    assert generate("a.mp4") == generate("b.mp4"), "the second command downloads the first one's video"
    jobs = [
        j
        for j in client.stub.ListJobs(gateway_pb2.ListJobsRequest(page_size=1000)).jobs
        if j.request_id == "cli-retry-1"
    ]
    assert len(jobs) == 1 and jobs[0].attempts == 1
