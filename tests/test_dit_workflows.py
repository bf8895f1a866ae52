"""The DiT's workflow table: partitions per configuration, the tensors a spec requires, refusals."""

from __future__ import annotations

import pytest

from h3serve.v1 import common_pb2, dit_pb2, media_pb2
from h3serve.services.dit import workflows as wf
from h3serve.services.dit.server import job_from_spec

T2VA, FL2VA, REF2VA = common_pb2.WORKFLOW_T2VA, common_pb2.WORKFLOW_FL2VA, common_pb2.WORKFLOW_REF2VA


def test_only_the_configured_partitions_are_loaded():
    assert wf.partitions(wf.served(["t2va"])) == ["transformer"]
    assert wf.partitions(wf.served(["t2va", "fl2va"])) == ["transformer"]
    assert wf.partitions(wf.served(["ref2va"])) == ["transformer_ref"]
    assert wf.partitions(wf.served(["fl2va", "ref2va"])) == ["transformer", "transformer_ref"]
    with pytest.raises(ValueError, match="workflows: \\['i2v'\\]; choose from t2va, fl2va, ref2va"):
        wf.served(["t2va", "i2v"])


def test_a_workflow_the_service_does_not_serve_is_refused():
    with pytest.raises(ValueError) as err:
        job_from_spec(dit_pb2.DenoiseSpec(workflow=REF2VA), [T2VA, FL2VA])
    assert str(err.value) == "workflow: WORKFLOW_REF2VA is not served by this DiT (serves WORKFLOW_T2VA, WORKFLOW_FL2VA)"
    assert job_from_spec(dit_pb2.DenoiseSpec(), [T2VA]).workflow == T2VA


def test_the_spec_names_every_tensor_a_request_carries():
    assert wf.tensor_names(dit_pb2.DenoiseSpec()) == ("prompt_embeds", "text_token_tags")
    fl2va = dit_pb2.DenoiseSpec(workflow=FL2VA, keyframe_anchors=["first", "last"])
    assert wf.tensor_names(fl2va)[2:] == ("condition_latents.0", "condition_latents.1")
    ref2va = dit_pb2.DenoiseSpec(workflow=REF2VA, references=[
        media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_VIDEO, has_audio=True),
        media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_IMAGE),
        media_pb2.ReferenceEntry(kind=media_pb2.ASSET_KIND_AUDIO, has_audio=True)])
    assert wf.tensor_names(ref2va)[2:] == ("condition_latents.0", "condition_latents.1", "audio_condition_latents.0",
                                           "audio_condition_latents.1")
    stand_ins = wf.Conditioning.from_spec(ref2va, {}).inputs["normalized_references"]
    assert [(r.kind, r.has_audio) for r in stand_ins] == [("video", True), ("image", False), ("audio", True)]


def test_bad_conditioning_specs_are_refused():
    with pytest.raises(ValueError, match="keyframe_anchors: fl2va needs 'first' and/or 'last', got \\['middle'\\]"):
        wf.Conditioning.from_spec(dit_pb2.DenoiseSpec(workflow=FL2VA, keyframe_anchors=["middle"]), {})
    with pytest.raises(ValueError, match="references: ref2va needs at least one reference"):
        wf.Conditioning.from_spec(dit_pb2.DenoiseSpec(workflow=REF2VA), {})
    with pytest.raises(ValueError, match="t2va takes no keyframe_anchors or references"):
        wf.Conditioning.from_spec(dit_pb2.DenoiseSpec(keyframe_anchors=["first"]), {})
