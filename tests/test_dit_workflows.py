"""The workflow registry as the DiT uses it: partitions per configuration, the tensors a spec requires, the
conditioning inputs of each workflow, and every refusal."""

from __future__ import annotations

import pytest

from h3serve.model import workflows
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
    ref2va = dit_pb2.DenoiseSpec(workflow=REF2VA, references=[
        media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_VIDEO, has_audio=True),
        media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_IMAGE),
        media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_AUDIO, has_audio=True)])
    flow = workflows.by_value(REF2VA)
    assert flow.tensor_names(ref2va)[2:] == ("condition_latents.0", "condition_latents.1",
                                             "audio_condition_latents.0", "audio_condition_latents.1")
    latents = {name: name for name in flow.tensor_names(ref2va)}
    inputs = flow.denoise_inputs(ref2va, latents)
    assert [(r.kind, r.has_audio) for r in inputs["normalized_references"]] == [("video", True), ("image", False),
                                                                                ("audio", True)]
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
    assert workflows.of_request(gateway_pb2.GenerateRequest(
        references=[gateway_pb2.ReferenceInput(asset_id="a")])).name == "ref2va"
    assert [w.name for w in workflows.WORKFLOWS] == workflows.names() == ["t2va", "fl2va", "ref2va"]
    assert {w.partition for w in workflows.WORKFLOWS} == {"transformer", "transformer_ref"}
