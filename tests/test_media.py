"""fl2va and ref2va end to end: uploads, validation, and bit-identity with in-process MiniMaxH3Blocks.

The stack runs with the reference geometry shrunk through the pipeline configs (canvas short edge 32,
area 2048, image references at a 64 short edge), as the in-process reference does, so every workflow
runs on CPU in seconds; the same files go to both.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
from deployments import write_config
from forked import run_forked

from bench.media_files import image, mp4, wav
from h3serve.cli.launcher import ServiceGroup
from h3serve.cli.reference import ReferenceRequest, base_params, run_reference
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.model.rules import Geometry
from h3serve.runtime.models import ModelSource
from h3serve.v1 import common_pb2, dit_pb2_grpc, gateway_pb2, gateway_pb2_grpc, media_pb2

pytestmark = pytest.mark.processes

GEOMETRY = Geometry(canvas_short_edge=32, canvas_max_pixels=2048, reference_image_short_edge=64)
LIMITS = dict(max_audio_seconds=4.5, max_rows=1000)
STEPS, SEED = 4, 11


@pytest.fixture(scope="module")
def media_stack(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("media-stack")
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    config = write_config(
        root / "deploy.toml", str(tiny_model_dir), root / "gateway", ports, model=GEOMETRY.pipeline_configs(), **LIMITS
    )
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(root)):
        yield root, ports


@pytest.fixture(scope="module")
def client(media_stack):
    client = GatewayClient(f"127.0.0.1:{media_stack[1]['gateway']}")
    yield client
    client.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("media")
    return {
        "wide": image(d / "wide.png", 48, 32, seed=1),
        "tall": image(d / "tall.jpg", 30, 40, seed=2, fmt="JPEG"),
        "video": mp4(d / "clip.mp4", 64, 36, 30, seed=3),
        "voice": wav(d / "voice.wav", 2.0, seed=4),
        "long": wav(d / "long.wav", 5.0, seed=5),
        "short": wav(d / "short.wav", 4.0, seed=6),
    }


def generate(client, request: gateway_pb2.GenerateRequest):
    events = []
    final = client.generate(request, events.append)
    assert final.WhichOneof("kind") == "done", final
    return final, events


def assert_matches_diffusers(client, tmp_path, final, events, reference: ReferenceRequest, model_dir: Path):
    """diffusers' monolithic pipeline on the model directory the services load: loaded from disk, the processor is
    the torchvision Qwen2VLImageProcessor, which rounds differently from the preset's PIL one built in memory."""
    served = np.load(client.download(final.done.raw.artifact_id, tmp_path / "served.npz"))
    expected = run_reference(ModelSource(str(model_dir)), reference, geometry=GEOMETRY)
    assert served["frames"].shape == expected["frames"].shape
    assert np.array_equal(served["frames"], expected["frames"])
    assert np.array_equal(served["audio"], expected["audio"])
    accepted = events[0].accepted.request
    assert accepted.condition_rows == int(expected["condition_rows"].sum()) > 0, (
        "the gateway counted exactly the rows diffusers packed"
    )
    # The text rows include every vision token of the keyframes / references: the gateway predicted them at submit.
    assert accepted.text_rows == int(expected["text_rows"]) > len(accepted.prompt.encode())
    assert accepted.total_rows == int(expected["packed_rows"])


@pytest.mark.fidelity
@pytest.mark.parametrize("frames", [("wide", None), (None, "wide"), ("wide", "tall")], ids=["first", "last", "both"])
def test_fl2va_is_bit_identical_to_diffusers(client, files, tmp_path, tiny_model_dir, frames):
    first, last = (files[name] if name else None for name in frames)
    request = gateway_pb2.GenerateRequest(
        prompt="<Picture 1> turns into a storm", num_inference_steps=STEPS, seed=SEED, include_raw=True
    )
    if first:
        request.first_frame = client.upload(first).asset_id
    if last:
        request.last_frame = client.upload(last).asset_id
    final, events = generate(client, request)
    accepted = events[0].accepted.request
    assert accepted.workflow == common_pb2.WORKFLOW_FL2VA
    # No height/width given: the canvas follows the first keyframe (48x32 and 30x40 at short edge 32).
    assert (accepted.height, accepted.width) == (32, 64)
    assert [e.conditioning.done for e in events if e.HasField("conditioning")] == list(
        range(1, 1 + sum(map(bool, frames)))
    )
    assert_matches_diffusers(
        client,
        tmp_path,
        final,
        events,
        ReferenceRequest(
            request.prompt,
            None,
            None,
            124,
            base_params(STEPS, SEED),
            first_frame=first and str(first),
            last_frame=last and str(last),
        ),
        tiny_model_dir,
    )
    job = client.job(final.job_id)
    assert [s.stage for s in job.stages] == ["encode", "condition", "denoise", "decode", "mux"]
    records = {r.stage: r for r in job.stage_records}
    assert list(records) == ["encoder", "vae-encode", "dit", "vae"], "the VAE encodes keyframes as its own stage"
    assert records["vae-encode"].bytes_out > 0 and records["vae-encode"].finished <= records["dit"].started


REF2VA_CASES = {
    "image+audio": [("image", "wide"), ("audio", "voice")],
    "video+image+audio": [("video", "video"), ("image", "tall"), ("audio", "voice")],
}


@pytest.mark.fidelity
@pytest.mark.parametrize("case", REF2VA_CASES)
def test_ref2va_is_bit_identical_to_diffusers(client, files, tmp_path, tiny_model_dir, case):
    kinds = {
        "image": media_pb2.ASSET_KIND_IMAGE,
        "video": media_pb2.ASSET_KIND_VIDEO,
        "audio": media_pb2.ASSET_KIND_AUDIO,
    }
    refs = REF2VA_CASES[case]
    request = gateway_pb2.GenerateRequest(
        prompt="<Picture 1> sings <Audio 1>",
        height=32,
        width=64,
        num_inference_steps=STEPS,
        seed=SEED,
        include_raw=True,
    )
    for kind, name in refs:
        request.references.add(asset_id=client.upload(files[name]).asset_id, kind=kinds[kind])
    final, events = generate(client, request)
    accepted = events[0].accepted.request
    assert accepted.workflow == common_pb2.WORKFLOW_REF2VA
    expected_labels = {
        "image+audio": ["<Picture 1>", "<Audio 1>"],
        "video+image+audio": ["<Audio 1> <Video 1>", "<Picture 1>", "<Audio 2>"],
    }[case]
    assert [r.label for r in accepted.references] == expected_labels
    assert_matches_diffusers(
        client,
        tmp_path,
        final,
        events,
        ReferenceRequest(
            request.prompt, 32, 64, 124, base_params(STEPS, SEED), references=tuple((k, str(files[n])) for k, n in refs)
        ),
        tiny_model_dir,
    )


def test_dit_reports_its_workflows_and_partitions(media_stack):
    with grpc.insecure_channel(f"127.0.0.1:{media_stack[1]['dit']}") as channel:
        info = dit_pb2_grpc.DiTStub(channel).Info(common_pb2.InfoRequest())
    assert list(info.workflows) == [common_pb2.WORKFLOW_T2VA, common_pb2.WORKFLOW_FL2VA, common_pb2.WORKFLOW_REF2VA]
    assert list(info.partitions) == ["transformer", "transformer_ref"]
    assert {"transformer", "transformer_ref"} <= set(info.model.components)


def test_same_file_uploaded_twice_is_stored_once(client, media_stack, files):
    first, second = client.upload(files["wide"]), client.upload(files["wide"])
    assert first.asset_id == second.asset_id and second.deduplicated
    assert (first.kind, first.format, first.width, first.height) == (media_pb2.ASSET_KIND_IMAGE, "png", 48, 32)
    blobs = list((media_stack[0] / "gateway" / "assets" / "blobs").iterdir())
    assert [b.name for b in blobs].count(first.asset_id) == 1
    assert (media_stack[0] / "gateway" / "assets" / "blobs" / first.asset_id).read_bytes() == files["wide"].read_bytes()
    video = client.upload(files["video"])
    assert (video.kind, video.num_frames, video.fps, video.has_audio, video.sample_rate) == (
        media_pb2.ASSET_KIND_VIDEO,
        30,
        24.0,
        True,
        32000,
    )


def _refused(client, path: Path):
    with pytest.raises(grpc.RpcError) as err:
        client.upload(path)
    return err.value


def test_invalid_assets_are_refused_with_the_reason(client, files, tmp_path):
    text = tmp_path / "photo.png"
    text.write_text("this is not a picture, whatever its name says\n")
    err = _refused(client, text)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("asset 'photo.png': not a supported image")

    truncated = tmp_path / "cut.mp4"
    truncated.write_bytes(files["video"].read_bytes()[:2000])
    err = _refused(client, truncated)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("asset 'cut.mp4': not a decodable mp4 file")

    err = _refused(client, files["long"])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("asset 'long.wav': audio duration past 4.5 s, over the limit of 4.5 s (max_audio_seconds)")

    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    err = _refused(client, empty)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "asset 'empty.wav': empty file (0 bytes)"


def test_an_upload_refused_mid_stream_is_heard_by_an_async_client_still_sending(media_stack, files):
    """grpc.aio reports a call refused while it still writes as INTERNAL unless the gateway reads the rest of the
    upload first: a PNG over max_image_bytes (20 MiB), sent in 1 MiB chunks, is refused as itself each time."""
    data = files["wide"].read_bytes() + bytes(21 << 20)
    chunks = [
        gateway_pb2.UploadAssetChunk(file_name="big.png", data=data[i : i + (1 << 20)])
        for i in range(0, len(data), 1 << 20)
    ]

    async def refusals() -> list[tuple[grpc.StatusCode, str]]:
        seen = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{media_stack[1]['gateway']}") as channel:
            for _ in range(4):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await gateway_pb2_grpc.GatewayStub(channel).UploadAsset(iter(chunks))
                seen.append((caught.value.code(), caught.value.details()))
        return seen

    seen = asyncio.run(refusals())
    assert {code for code, _ in seen} == {grpc.StatusCode.INVALID_ARGUMENT}, seen
    assert all("max_image_bytes" in details for _, details in seen), seen


def _generate_refused(client, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(request)
    return err.value


def test_a_tenth_image_is_refused(client, tmp_path):
    request = gateway_pb2.GenerateRequest(prompt="ten pictures", height=32, width=64)
    for index in range(10):
        request.references.add(asset_id=client.upload(image(tmp_path / f"{index}.png", 32, 32, seed=index)).asset_id)
    err = _generate_refused(client, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "references[9]: a 10th image reference; at most 9 image references"


def test_prompt_naming_a_missing_reference_is_refused(client, files):
    request = gateway_pb2.GenerateRequest(prompt="<Picture 1> and <Video 1>", height=32, width=64)
    request.references.add(asset_id=client.upload(files["wide"]).asset_id)
    err = _generate_refused(client, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("prompt: names <Video 1>, but the request has 0 video(s)")

    request.references[0].kind = media_pb2.ASSET_KIND_AUDIO
    err = _generate_refused(client, request)
    assert err.details().startswith(f"references[0]: asset {request.references[0].asset_id!r} holds image, not audio")

    unknown = gateway_pb2.GenerateRequest(prompt="a", first_frame="0" * 64)
    err = _generate_refused(client, unknown)
    assert err.details().startswith(f"first_frame: no asset {'0' * 64!r}")


def test_request_over_capacity_is_refused_at_submit_with_the_numbers(client, files):
    request = gateway_pb2.GenerateRequest(prompt="<Picture 1>", height=32, width=64)
    request.references.add(asset_id=client.upload(files["wide"]).asset_id)
    for _ in range(3):
        request.references.add(asset_id=client.upload(files["short"]).asset_id)
    err = _generate_refused(client, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, "over capacity: the same request is refused again"
    # 48x32 image at a 64 short edge -> 96x64 -> 6 rows; 3 x 4 s of audio -> 3 x 2 x 160 rows;
    # generated 37 latent frames x 2 rows + 2 x 207 audio rows; text: the 11-byte prompt, "<Picture 1>: " (13) and
    # a vision block of 6 + 2 rows (96x64 in 32-pixel merged patches), three "<Audio j>: " (11 each).
    assert err.details() == (
        "references: 32x64 allows no video here, not even 124 frames: 124 frames need 1,519 "
        "packed rows (text 65, audio 414, video 74, conditioning 966), this deployment's "
        "max_rows is 1,000"
    )


def test_cli_generate_and_reference_agree_on_keyframes(media_stack, files, tiny_model_dir, fork_server, tmp_path):
    """`generate --first-frame --last-frame` uploads and runs; `reference` with the same files, the deployment's
    geometry (--config) and the model directory writes the same frames and waveform."""
    import subprocess
    import sys

    media = [
        "--prompt",
        "<Picture 2> at dusk",
        "--first-frame",
        str(files["wide"]),
        "--last-frame",
        str(files["tall"]),
        "--steps",
        "3",
        "--seed",
        "2",
    ]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "h3serve.cli",
            "generate",
            "--gateway",
            f"127.0.0.1:{media_stack[1]['gateway']}",
            *media,
            "--out",
            str(tmp_path / "fl.mp4"),
            "--raw",
            str(tmp_path / "served.npz"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert (tmp_path / "fl.mp4").stat().st_size > 0
    assert "stages: encode" in out.stdout and "condition" in out.stdout
    run_forked(  # a fork of the session's fork server: its imports done
        fork_server,
        [
            sys.executable,
            "-m",
            "h3serve.cli",
            "reference",
            "--model-dir",
            str(tiny_model_dir),
            "--config",
            str(media_stack[0] / "deploy.toml"),
            *media,
            "--raw",
            str(tmp_path / "ref.npz"),
        ],
    )
    served, reference = np.load(tmp_path / "served.npz"), np.load(tmp_path / "ref.npz")
    assert served["frames"].shape == (124, 32, 64, 3)
    assert np.array_equal(served["frames"], reference["frames"]) and np.array_equal(served["audio"], reference["audio"])


def _stub(media_stack, name: str, module, service: str):
    return getattr(module, f"{service}Stub")(grpc.insecure_channel(f"127.0.0.1:{media_stack[1][name]}"))


def test_stage_media_rpcs_refuse_malformed_streams_and_media(media_stack, files):
    from h3serve.v1 import dit_pb2, encoder_pb2_grpc, vae_pb2_grpc

    encoder = _stub(media_stack, "encoder", encoder_pb2_grpc, "Encoder")
    vae = _stub(media_stack, "vae", vae_pb2_grpc, "VAE")
    data = files["voice"].read_bytes()
    chunk = media_pb2.MediaInput(chunk=media_pb2.MediaChunk(asset_id="a", data=data))

    def spec(kind: int) -> media_pb2.MediaInput:
        item = media_pb2.MediaItem(asset_id="a", kind=kind, role=media_pb2.MEDIA_ROLE_REFERENCE, bytes=len(data))
        return media_pb2.MediaInput(
            spec=media_pb2.MediaSpec(
                workflow=common_pb2.WORKFLOW_REF2VA, height=32, width=64, num_frames=124, items=[item], prompt="a voice"
            )
        )

    cases = [
        ([chunk], "unexpected chunk message: send one spec, then the assets' chunks"),
        ([spec(media_pb2.ASSET_KIND_IMAGE)], f"asset 'a' truncated: 0 of {len(data)} bytes arrived"),
        # The model's rule, checked on the spec before any byte is read: audio needs a picture or a video.
        (
            [spec(media_pb2.ASSET_KIND_AUDIO), chunk],
            "items: audio references need at least one image or video reference with them",
        ),
        # Complete and well formed, but not what it claims to be: named by the asset and what its bytes are, not a path.
        ([spec(media_pb2.ASSET_KIND_IMAGE), chunk], "asset a: declared an image, but its bytes are audio (wav)"),
    ]
    for stub, rpc in ((encoder, "EncodeMedia"), (vae, "EncodeConditions")):
        for messages, reason in cases:
            with pytest.raises(grpc.RpcError) as err:
                list(getattr(stub, rpc)(iter(messages)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, err.value.details())
            assert err.value.details().startswith(reason), (rpc, err.value.details())

    dit = _stub(media_stack, "dit", dit_pb2_grpc, "DiT")
    fl2va = dit_pb2.DenoiseSpec(
        workflow=common_pb2.WORKFLOW_FL2VA,
        height=32,
        width=64,
        num_frames=124,
        params=common_pb2.GenerationParams(num_inference_steps=2),
        keyframe_anchors=["first"],
    )
    with pytest.raises(grpc.RpcError) as err:
        list(dit.Denoise(iter([dit_pb2.DenoiseInput(spec=fl2va)])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "condition_latents.0" in err.value.details()


def test_a_repeated_conditioned_request_hits_the_encoder_cache(client, files):
    request = gateway_pb2.GenerateRequest(
        prompt="<Picture 1> waves, cache probe",
        height=32,
        width=64,
        num_inference_steps=2,
        first_frame=client.upload(files["tall"]).asset_id,
    )
    hits = []
    for seed in (1, 2):
        request.seed = seed
        _, events = generate(client, request)
        hits += [e.encoding.cache_hit for e in events if e.HasField("encoding")]
    assert hits == [False, True]
