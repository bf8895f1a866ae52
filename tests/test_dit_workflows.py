"""The workflow registry as the DiT uses it: partitions per configuration, the tensors a spec requires, the
conditioning inputs of each workflow, and every refusal."""

from __future__ import annotations

import pytest

from h3serve.model import workflows
from h3serve.model.rules import Geometry, InvalidRequest
from h3serve.model.workflows.base import ModelDims
from h3serve.services.dit.checks import served_workflow
from h3serve.services.dit.runner import partitions, served
from h3serve.v1 import common_pb2, dit_pb2, gateway_pb2, media_pb2

T2VA, FL2VA, REF2VA = common_pb2.WORKFLOW_T2VA, common_pb2.WORKFLOW_FL2VA, common_pb2.WORKFLOW_REF2VA


def test_only_the_configured_partitions_are_loaded():
    assert partitions(served(["t2va"])) == ["transformer"]
    assert partitions(served(["t2va", "fl2va"])) == ["transformer"]
    assert partitions(served(["ref2va"])) == ["transformer_ref"]
    assert partitions(served(["fl2va", "ref2va"])) == ["transformer", "transformer_ref"]
    with pytest.raises(ValueError, match="workflow: unknown 'i2v'; one of t2va, fl2va, ref2va"):
        served(["t2va", "i2v"])
    with pytest.raises(ValueError, match="workflows: none given"):
        served([])


def test_a_workflow_the_service_does_not_serve_is_refused():
    with pytest.raises(ValueError) as err:
        served_workflow(dit_pb2.DenoiseSpec(workflow=REF2VA), [T2VA, FL2VA])
    assert str(err.value) == "workflow: ref2va is not served by this DiT (serves t2va, fl2va)"
    assert served_workflow(dit_pb2.DenoiseSpec(), [T2VA]).value == T2VA, "unspecified reads as t2va"
    with pytest.raises(ValueError, match="workflow: unknown value 9"):
        served_workflow(dit_pb2.DenoiseSpec(workflow=9), [T2VA])


def test_the_spec_names_every_tensor_a_request_carries():
    assert workflows.by_value(T2VA).tensor_names(dit_pb2.DenoiseSpec()) == ("prompt_embeds", "text_token_tags")
    fl2va = dit_pb2.DenoiseSpec(workflow=FL2VA, keyframe_anchors=["first", "last"])
    assert workflows.by_value(FL2VA).tensor_names(fl2va)[2:] == ("condition_latents.0", "condition_latents.1")
    ref2va = dit_pb2.DenoiseSpec(
        workflow=REF2VA,
        references=[
            media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_VIDEO, has_audio=True),
            media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_IMAGE),
            media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_AUDIO, has_audio=True),
        ],
    )
    flow = workflows.by_value(REF2VA)
    assert flow.tensor_names(ref2va)[2:] == (
        "condition_latents.0",
        "condition_latents.1",
        "audio_condition_latents.0",
        "audio_condition_latents.1",
    )
    latents = {name: name for name in flow.tensor_names(ref2va)}
    inputs = flow.denoise_inputs(ref2va, latents)
    assert [(r.kind, r.has_audio) for r in inputs["normalized_references"]] == [
        ("video", True),
        ("image", False),
        ("audio", True),
    ]
    assert inputs["condition_latents"] == ["condition_latents.0", "condition_latents.1"]


def test_bad_conditioning_specs_are_refused():
    with pytest.raises(ValueError, match="keyframe_anchors: fl2va needs 'first' and/or 'last', got \\['middle'\\]"):
        workflows.by_value(FL2VA).denoise_inputs(dit_pb2.DenoiseSpec(workflow=FL2VA, keyframe_anchors=["middle"]), {})
    with pytest.raises(ValueError, match="references: ref2va needs at least one reference"):
        workflows.by_value(REF2VA).denoise_inputs(dit_pb2.DenoiseSpec(workflow=REF2VA), {})
    with pytest.raises(ValueError, match="keyframe_anchors / references: t2va takes none"):
        workflows.by_value(T2VA).denoise_inputs(dit_pb2.DenoiseSpec(keyframe_anchors=["first"]), {})


def test_a_request_names_its_workflow_or_its_media_do():
    assert workflows.of_request(gateway_pb2.GenerateRequest()).name == "t2va"
    assert workflows.of_request(gateway_pb2.GenerateRequest(last_frame="a")).name == "fl2va"
    assert (
        workflows.of_request(gateway_pb2.GenerateRequest(references=[gateway_pb2.ReferenceInput(asset_id="a")])).name
        == "ref2va"
    )
    assert [w.name for w in workflows.WORKFLOWS] == workflows.names() == ["t2va", "fl2va", "ref2va"]
    assert {w.partition for w in workflows.WORKFLOWS} == {"transformer", "transformer_ref"}


IMAGE, VIDEO, AUDIO = media_pb2.ASSET_KIND_IMAGE, media_pb2.ASSET_KIND_VIDEO, media_pb2.ASSET_KIND_AUDIO
DIMS = ModelDims(text_dim=32, latent_channels=24, audio_latent_channels=32)


def _ref2va(*entries) -> dit_pb2.DenoiseSpec:
    return dit_pb2.DenoiseSpec(
        workflow=REF2VA,
        height=32,
        width=64,
        num_frames=124,
        references=[media_pb2.ReferenceEntry(kind=k, has_audio=a) for k, a in entries],
    )


@pytest.mark.parametrize(
    "spec,message",
    [
        (dit_pb2.DenoiseSpec(workflow=FL2VA, keyframe_anchors=["first", "first"]), "keyframe_anchors: fl2va needs"),
        (dit_pb2.DenoiseSpec(workflow=FL2VA, keyframe_anchors=["last"] * 1000), "got 1000 anchors"),
        (_ref2va((AUDIO, True)), "references: audio references need at least one image or video reference"),
        (_ref2va((IMAGE, True)), r"references\[0\]: an image reference has no audio"),
        (_ref2va((IMAGE, False), (AUDIO, False)), r"references\[1\]: an audio reference is its audio"),
        (_ref2va((0, False)), "references: asset kind 0"),
        (_ref2va(*[(IMAGE, False)] * 10), "10 image references; at most 9"),
    ],
)
def test_a_manifest_the_model_cannot_lay_out_is_refused_before_any_tensor(spec, message):
    with pytest.raises(ValueError, match=message):
        workflows.by_value(spec.workflow).check_manifest(spec)


@pytest.mark.parametrize(
    "shapes,message",
    [
        ({"condition_latents.0": (1, 24, 1, 2, 4)}, None),
        (
            {"condition_latents.0": (1, 24, 1, 4, 4)},
            r"condition_latents.0: shape \[1, 24, 1, 4, 4\], expected "
            r"\[1, 24, 1, 2, 4\]",
        ),
        ({"condition_latents.0": (24, 1, 2, 4)}, "expected"),
    ],
)
def test_keyframe_latents_are_one_frame_of_the_canvas(shapes, message):
    spec = dit_pb2.DenoiseSpec(workflow=FL2VA, height=32, width=64, num_frames=124, keyframe_anchors=["first"])
    check = workflows.by_value(FL2VA).check_conditioning
    if message is None:
        check(spec, shapes, DIMS, Geometry())
    else:
        with pytest.raises(InvalidRequest, match=message):
            check(spec, shapes, DIMS, Geometry())


@pytest.mark.parametrize(
    "latents,audio,message",
    [
        ((1, 24, 7, 2, 4), (414, 32), None),  # a 22-frame clip, a whole-length soundtrack
        ((1, 24, 37, 2, 4), (2, 32), None),  # as long as the video (124 frames)
        ((1, 24, 42, 2, 4), (2, 32), "42 latent frames; a video reference is 5n\\+2"),  # 141 frames: too long
        ((1, 24, 8, 2, 4), (2, 32), "8 latent frames"),
        ((1, 24, 7, 3, 4), (2, 32), "each side a multiple of 2"),
        ((1, 24, 7, 2, 2**20), (2, 32), "at most 48 on the short side and 192"),
        ((1, 24, 7, 2, 4), (3, 32), "3 rows; a soundtrack takes an even number"),
        ((1, 24, 7, 2, 4), (420, 32), "at most 416 for 124 frames"),
        ((1, 24, 7, 2, 4), (2, 64), r"audio_condition_latents.0: shape \[2, 64\]"),
    ],
)
def test_reference_latents_fit_the_manifest_and_the_geometry(latents, audio, message):
    spec = _ref2va((VIDEO, True))
    shapes = {"condition_latents.0": latents, "audio_condition_latents.0": audio}
    check = workflows.by_value(REF2VA).check_conditioning
    if message is None:
        check(spec, shapes, DIMS, Geometry())
    else:
        with pytest.raises(InvalidRequest, match=message):
            check(spec, shapes, DIMS, Geometry())
