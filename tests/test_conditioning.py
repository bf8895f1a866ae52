"""fl2va / ref2va request resolution at the gateway: each refusal names the field and the rule."""

from __future__ import annotations

import pytest

from h3serve.gateway.admission.capacity import CapacityTable, OverCapacity
from h3serve.gateway.admission.request import RequestLimits, resolve
from h3serve.model.rules import InvalidRequest
from h3serve.v1 import common_pb2, gateway_pb2, media_pb2

IMAGE, VIDEO, AUDIO = media_pb2.ASSET_KIND_IMAGE, media_pb2.ASSET_KIND_VIDEO, media_pb2.ASSET_KIND_AUDIO
ASSETS = {
    "wide": gateway_pb2.Asset(asset_id="wide", kind=IMAGE, width=1920, height=1080),
    "tall": gateway_pb2.Asset(asset_id="tall", kind=IMAGE, width=1080, height=1920),
    "strip": gateway_pb2.Asset(asset_id="strip", kind=IMAGE, width=500, height=100),
    "clip": gateway_pb2.Asset(
        asset_id="clip",
        kind=VIDEO,
        width=1280,
        height=720,
        num_frames=48,
        fps=24.0,
        has_audio=True,
        sample_rate=48000,
        audio_samples=96000,
    ),
    "blink": gateway_pb2.Asset(asset_id="blink", kind=VIDEO, width=1280, height=720, num_frames=10, fps=12.0),
    "voice": gateway_pb2.Asset(asset_id="voice", kind=AUDIO, has_audio=True, sample_rate=32000, audio_samples=64000),
}


def _resolve(**fields) -> gateway_pb2.ResolvedRequest:
    fields.setdefault("prompt", "a scene")
    return resolve(gateway_pb2.GenerateRequest(**fields), RequestLimits(), ASSETS.get)


def _refs(*names: str) -> list[gateway_pb2.ReferenceInput]:
    return [gateway_pb2.ReferenceInput(asset_id=name) for name in names]


def test_fl2va_canvas_follows_the_first_keyframe_unless_given():
    assert (_resolve(first_frame="wide").height, _resolve(first_frame="wide").width) == (768, 1344)
    both = _resolve(first_frame="tall", last_frame="wide")
    assert (both.height, both.width, both.first_frame, both.last_frame) == (1344, 768, "tall", "wide")
    assert (_resolve(last_frame="tall").height, _resolve(last_frame="tall").width) == (1344, 768)
    given = _resolve(first_frame="tall", height=480, width=832)
    assert (given.height, given.width) == (480, 832)
    assert given.condition_rows == 390


def test_ref2va_labels_follow_the_models_numbering():
    resolved = _resolve(
        references=_refs("clip", "wide", "voice", "tall"),
        prompt="<Picture 2> meets <Picture 1> to <Audio 2> like <Video 1>",
    )
    assert resolved.workflow == common_pb2.WORKFLOW_REF2VA
    assert [r.label for r in resolved.references] == ["<Audio 1> <Video 1>", "<Picture 1>", "<Audio 2>", "<Picture 2>"]
    assert (resolved.height, resolved.width) == (768, 1344)


REFUSALS = [
    ("first_frame", dict(first_frame="voice"), "asset 'voice' holds audio; keyframes are images"),
    ("first_frame", dict(first_frame="strip"), "aspect ratio must be within 1:4 and 4:1, got 500x100"),
    (
        "references",
        dict(workflow=common_pb2.WORKFLOW_FL2VA, first_frame="wide", references=_refs("wide")),
        "ref2va media; a fl2va request takes first_frame, last_frame",
    ),
    (
        "last_frame",
        dict(workflow=common_pb2.WORKFLOW_REF2VA, last_frame="wide", references=_refs("wide")),
        "fl2va media; a ref2va request takes references",
    ),
    (
        "first_frame",
        dict(workflow=common_pb2.WORKFLOW_T2VA, first_frame="wide"),
        "fl2va media; a t2va request takes no media",
    ),
    ("references", dict(references=_refs("voice")), "audio references need at least one image or video reference"),
    (
        "references[3]",
        dict(references=_refs("clip", "clip", "clip", "clip")),
        "a 4th video reference; at most 3 video references",
    ),
    (
        "references",
        dict(references=_refs(*["wide"] * 9, "clip", "clip", "clip", "voice")),
        "13 references; at most 12 in all",
    ),
    (
        "references[0]",
        dict(references=_refs("blink")),
        "a video reference needs at least 22 frames at 24 fps (17n+5, n >= 1), got 20",
    ),
    ("references[0]", dict(references=_refs("strip")), "aspect ratio must be within 1:4 and 4:1, got 500x100"),
    (
        "references[0]",
        dict(references=[gateway_pb2.ReferenceInput(asset_id="wide", kind=VIDEO)]),
        "asset 'wide' holds image, not video",
    ),
    ("references[1]", dict(references=_refs("wide", "nope")), "no asset 'nope'"),
    (
        "prompt",
        dict(first_frame="wide", prompt="from <Picture 1> to <Picture 2>"),
        "names <Picture 2>, but the request has 1 picture(s)",
    ),
    (
        "prompt",
        dict(references=_refs("wide", "voice"), prompt="<Audio 2>"),
        "names <Audio 2>, but the request has 1 audio(s)",
    ),
    ("prompt", dict(prompt="like <Video 1>"), "names <Video 1>, but the request has 0 video(s)"),
]


@pytest.mark.parametrize("field,fields,reason", REFUSALS, ids=[r[2][:40] for r in REFUSALS])
def test_refusals_name_the_field_and_the_rule(field, fields, reason):
    with pytest.raises(InvalidRequest) as err:
        _resolve(**fields)
    assert err.value.field == field and reason in err.value.message, err.value.message


def test_admission_counts_reference_rows_and_refuses_with_the_numbers():
    # At the released geometry a 16:9 image reference is upscaled to 2048x3648: 7,296 rows.
    resolved = _resolve(references=_refs("wide"), height=480, width=832)
    resolved.text_rows = 7
    assert resolved.condition_rows == 7296
    assert CapacityTable({}, max_rows=10**6).admit(resolved).total == 7 + 7296 + 37 * 390 + 414
    two = _resolve(references=_refs("wide", "tall"), height=480, width=832)
    two.text_rows = 7
    with pytest.raises(OverCapacity) as err:
        CapacityTable({}, max_rows=20_000).admit(two)
    assert err.value.message == (
        "references: 480x832 allows no video here, not even 124 frames: 124 frames need "
        "29,443 packed rows (text 7, audio 414, video 14430, conditioning 14592), this "
        "deployment's max_rows is 20,000"
    )
    with pytest.raises(OverCapacity) as err:  # a ceiling that fits: the same format as the capacity table's
        CapacityTable({}, max_rows=40_000).admit(
            _resolve(references=_refs("wide"), height=480, width=832, num_frames=345)
        )
    # 260 frames: 77 latent frames x 390 + 2 x 433 audio + 7,296 = 38,192 rows; 277 frames would be 40,200.
    assert err.value.message == (
        "num_frames: 480x832 allows at most 260 frames here: 345 frames need 48,226 packed "
        "rows (text 0, audio 1150, video 39780, conditioning 7296), this deployment's "
        "max_rows is 40,000"
    )
