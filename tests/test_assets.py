"""Asset validation by content, the upload store's limits, and the gateway's conditioning arithmetic.

The arithmetic is checked against diffusers' own functions and against the row counts recorded in the
diffusers brief for the released geometry.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import grpc
import pytest

from bench.media_files import audio, image, mp4
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.assets.validate import AssetLimits, AssetRefused, inspect, sniff
from h3serve.gateway.blobs import DirectoryBlobs
from h3serve.model import rules, workflows
from h3serve.model.rules import Geometry
from h3serve.v1 import common_pb2, gateway_pb2, media_pb2

IMAGE, VIDEO, AUDIO = media_pb2.ASSET_KIND_IMAGE, media_pb2.ASSET_KIND_VIDEO, media_pb2.ASSET_KIND_AUDIO

FORMATS = [  # file name, maker, expected (kind, format)
    ("a.png", lambda p: image(p, 40, 30), (IMAGE, "png")),
    ("a.jpg", lambda p: image(p, 40, 30, fmt="JPEG"), (IMAGE, "jpeg")),
    ("a.webp", lambda p: image(p, 40, 30, fmt="WEBP"), (IMAGE, "webp")),
    ("a.mp4", lambda p: mp4(p, 64, 36, 24), (VIDEO, "mp4")),
    ("a.mov", lambda p: mp4(p, 64, 36, 24, container="mov"), (VIDEO, "mov")),
    ("a.webm", lambda p: mp4(p, 64, 36, 24, container="webm", codec="libvpx-vp9", audio_rate=48000), (VIDEO, "webm")),
    ("a.wav", lambda p: audio(p, 1.0), (AUDIO, "wav")),
    ("a.flac", lambda p: audio(p, 1.0, container="flac", codec="flac"), (AUDIO, "flac")),
    ("a.mp3", lambda p: audio(p, 1.0, container="mp3", codec="libmp3lame"), (AUDIO, "mp3")),
    ("a.aac", lambda p: audio(p, 1.0, container="adts", codec="aac"), (AUDIO, "aac")),
    ("a.m4a", lambda p: audio(p, 1.0, container="ipod", codec="aac"), (AUDIO, "m4a")),
    ("a.ogg", lambda p: audio(p, 1.0, rate=48000, container="ogg", codec="libopus"), (AUDIO, "ogg")),
]


@pytest.mark.parametrize("name,make,expected", FORMATS, ids=[f[0] for f in FORMATS])
def test_each_supported_format_is_recognised_by_content(tmp_path, name, make, expected):
    path = make(tmp_path / name)
    fmt = sniff(path.read_bytes()[:16])
    asset = inspect(str(path), name, fmt, path.stat().st_size, AssetLimits())
    assert (asset.kind, asset.format) == expected
    if asset.kind == AUDIO:
        assert asset.has_audio and asset.duration_s == pytest.approx(1.0, abs=0.1)
    if asset.kind == VIDEO:
        assert (asset.width, asset.height, asset.num_frames, asset.fps, asset.has_audio) == (64, 36, 24, 24.0, True)


async def _chunks(data: bytes, size: int, name: str):
    for offset in range(0, len(data), size):
        yield gateway_pb2.UploadAssetChunk(file_name=name if offset == 0 else "", data=data[offset : offset + size])


def _upload(tmp_path: Path, path: Path, limits: AssetLimits, chunk: int = 4096):
    store = AssetStore(DirectoryBlobs(str(tmp_path / "blobs")), str(tmp_path / "store"), limits)
    return store, asyncio.run(store.upload(_chunks(path.read_bytes(), chunk, path.name)))


def test_a_file_over_its_kinds_byte_limit_is_refused_while_streaming(tmp_path):
    path = image(tmp_path / "big.png", 200, 200)
    with pytest.raises(AssetRefused) as err:
        _upload(tmp_path, path, AssetLimits(max_image_bytes=10_000))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, "over a limit: not retryable"
    assert err.value.message == (
        "asset 'big.png': size more than 10000 bytes, over the limit of 10000 bytes (max_image_bytes)"
    )
    assert not list((tmp_path / "store" / "tmp").iterdir()), "the spooled part is removed"


def test_pixel_and_duration_limits_name_the_limit(tmp_path):
    with pytest.raises(AssetRefused) as err:
        _upload(tmp_path, image(tmp_path / "wide.png", 300, 100), AssetLimits(max_image_pixels=20_000))
    assert err.value.message == (
        "asset 'wide.png': image of 300x100 = 30000 pixels, over the limit of 20000 (max_image_pixels)"
    )
    with pytest.raises(AssetRefused) as err:
        _upload(tmp_path, mp4(tmp_path / "long.mp4", 64, 36, 48), AssetLimits(max_video_seconds=1.5))
    assert err.value.message == (
        "asset 'long.mp4': video duration past 1.5 s, over the limit of 1.5 s (max_video_seconds)"
    )


@pytest.mark.parametrize("head", [b"\x89PNG\r\n\x1a\n", b"\x00\x00\x00\x18ftypmp42"], ids=["png", "mp4"])
def test_an_undecodable_upload_is_named_by_its_file_name_never_by_the_servers_path(tmp_path, head):
    path = tmp_path / "broken.bin"
    path.write_bytes(head + b"\x00" * 64)
    with pytest.raises(AssetRefused) as err:
        _upload(tmp_path, path, AssetLimits())
    assert err.value.message.startswith("asset 'broken.bin': not a decodable ")
    assert str(tmp_path) not in err.value.message and "/tmp" not in err.value.message, err.value.message


def test_a_refusal_cuts_a_long_file_name(tmp_path):
    async def chunks():
        yield gateway_pb2.UploadAssetChunk(file_name="n" * 100_000, data=b"not media at all, just text")

    with pytest.raises(AssetRefused) as err:
        asyncio.run(AssetStore(DirectoryBlobs(str(tmp_path)), str(tmp_path / "store"), AssetLimits()).upload(chunks()))
    assert err.value.message.startswith("asset 'nnn") and "(100000 characters)" in err.value.message
    assert len(err.value.message) < 500


def test_an_upload_is_stored_under_its_sha256(tmp_path):
    import hashlib

    path = audio(tmp_path / "a.wav", 0.5)
    store, asset = _upload(tmp_path, path, AssetLimits())
    assert asset.asset_id == hashlib.sha256(path.read_bytes()).hexdigest() and not asset.deduplicated

    async def read():
        return b"".join([data async for data in store.read(asset.asset_id, chunk_bytes=1000)])

    assert asyncio.run(read()) == path.read_bytes()
    assert store.get(asset.asset_id) == asset
    assert store.get("../../etc/passwd") is None


_ids = itertools.count()


def _asset(kind, **fields) -> gateway_pb2.Asset:
    return gateway_pb2.Asset(asset_id=f"asset-{next(_ids)}", kind=kind, **fields)


def _rows(request: gateway_pb2.ResolvedRequest, *assets: gateway_pb2.Asset):
    for asset in assets:
        request.references.add(asset_id=asset.asset_id, kind=asset.kind, has_audio=asset.has_audio)
    return conditioning_rows(request, {a.asset_id: a for a in assets})


def conditioning_rows(request: gateway_pb2.ResolvedRequest, assets: dict):
    return workflows.by_value(request.workflow).condition_rows(request, assets.get, Geometry())


def test_rows_match_the_released_geometry_examples_of_the_brief():
    ref2va = dict(workflow=common_pb2.WORKFLOW_REF2VA, height=768, width=1344, num_frames=124)
    # A 40x30 image reference is upscaled to 2720x2048: 5,440 rows.
    assert _rows(gateway_pb2.ResolvedRequest(**ref2va), _asset(IMAGE, width=40, height=30)).condition_video == 5440
    # A 36x64 video reference goes onto 768x1344 and 12 latent frames: 12,096 rows.
    video = _asset(VIDEO, width=64, height=36, num_frames=48, fps=24.0)
    assert _rows(gateway_pb2.ResolvedRequest(**ref2va), video).condition_video == 12096
    # The packed ref2va example: a 16:9 image, a 5 s 16:9 video with sound, a 3 s audio; with 100 text tokens
    # the sequence is 83,056 rows, 44,592 of them conditioning video and 654 reference audio.
    rows = _rows(
        gateway_pb2.ResolvedRequest(**ref2va),
        _asset(IMAGE, width=1920, height=1080),
        _asset(
            VIDEO,
            width=1920,
            height=1080,
            num_frames=124,
            fps=24.0,
            has_audio=True,
            sample_rate=32000,
            audio_samples=165600,
            duration_s=5.2,
        ),
        _asset(AUDIO, has_audio=True, sample_rate=32000, audio_samples=96000, duration_s=3.0),
    )
    generated = rules.generated_rows(768, 1344, 124)
    assert (rows.condition_video, rows.condition_audio, 100 + rows.total + generated.total) == (44592, 654, 83056)
    # fl2va with both keyframes at 768x1344: 1008 rows each.
    fl2va = gateway_pb2.ResolvedRequest(
        workflow=common_pb2.WORKFLOW_FL2VA, height=768, width=1344, num_frames=124, first_frame="a", last_frame="b"
    )
    assert conditioning_rows(fl2va, {}).condition_video == 2016
