"""LoRA adapters and schedule shifts through the real stack (gateway, encoder, DiT, VAE processes): the served
bytes equal diffusers' in-process pipeline with `load_lora_weights` + `set_adapters` at the same scale, for t2va
and for ref2va on `transformer_ref`; the gateway resolves a request from the DiT's Info (sidecar recommendations)
and refuses what neither may run; the DiT refuses it again at its own boundary."""

from __future__ import annotations

import signal
import sys
import time

import grpc
import numpy as np
import pytest
from deployments import ADAPTER_GEOMETRY
from forked import run_forked

from bench.media_files import image
from h3serve.cli.reference import ReferenceRequest, run_reference
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.gateway.stages.replicas import HEALTH_TTL_S
from h3serve.model.rules import Geometry
from h3serve.runtime.models import ModelSource
from h3serve.v1 import common_pb2, dit_pb2, dit_pb2_grpc, gateway_pb2, media_pb2

pytestmark = pytest.mark.processes

GEOMETRY = Geometry(**ADAPTER_GEOMETRY)
PROMPT, SEED = "a kite over the dunes at noon", 9


@pytest.fixture(scope="module")
def client(adapter_stack):
    client = GatewayClient(f"127.0.0.1:{adapter_stack.ports['gateway']}")
    yield client
    client.close()


def request(*named, prompt: str = PROMPT, **fields) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(prompt=prompt, height=32, width=64, **fields)
    req.params.seed, req.params.include_raw = SEED, True
    for name, weight in named:
        req.params.adapters.add(name=name, weight=weight)
    return req


def served_and_resolved(client, tmp_path, req) -> tuple[dict, gateway_pb2.ResolvedRequest]:
    events = []
    final = client.generate(req, events.append)
    assert final.WhichOneof("kind") == "done", final
    with np.load(client.download(final.done.raw.artifact_id, tmp_path / f"{final.job_id}.npz")) as raw:
        return dict(raw), events[0].accepted.request


def reference(adapter_stack, resolved: gateway_pb2.ResolvedRequest, **media) -> dict:
    return run_reference(
        ModelSource(str(load_deploy(adapter_stack.config_path).dit.model_dir)),
        ReferenceRequest(
            resolved.prompt, resolved.height, resolved.width, resolved.num_frames, resolved.params, **media
        ),
        geometry=GEOMETRY,
        adapter_sources=load_deploy(adapter_stack.config_path).dit.adapters,
    )


def assert_same(served: dict, expected: dict) -> None:
    assert np.array_equal(served["frames"], expected["frames"])
    assert np.array_equal(served["audio"], expected["audio"])


@pytest.mark.fidelity
def test_t2va_with_two_adapters_is_bit_identical_to_diffusers(adapter_stack, client, tmp_path, fork_server):
    served, resolved = served_and_resolved(client, tmp_path, request(("turbo", 0.7), ("style", 0.0)))
    params = resolved.params
    assert [(a.name, a.weight) for a in params.adapters] == [("turbo", 0.7), ("style", 1.0)]
    assert (params.num_inference_steps, params.flow_shift, params.audio_flow_shift) == (3, 6.0, 2.5), (
        "the first adapter's sidecar recommends what the request left unset"
    )
    assert_same(served, reference(adapter_stack, resolved))

    # and through `h3serve reference`, which reads the same deployment file and resolves as the gateway does
    out = tmp_path / "cli.npz"
    run_forked(  # a fork of the session's fork server: its imports done
        fork_server,
        [
            sys.executable,
            "-m",
            "h3serve.cli",
            "reference",
            "--config",
            str(adapter_stack.config_path),
            "--prompt",
            PROMPT,
            "--height",
            "32",
            "--width",
            "64",
            "--seed",
            str(SEED),
            "--raw",
            str(out),
            "--adapter",
            "turbo:0.7",
            "--adapter",
            "style",
        ],
    )
    assert_same(served, np.load(out))

    base, resolved = served_and_resolved(client, tmp_path, request(num_inference_steps=3))
    assert (list(resolved.params.adapters), resolved.params.flow_shift) == ([], 12.0)
    assert_same(base, reference(adapter_stack, resolved))
    assert not np.array_equal(base["frames"], served["frames"])


@pytest.mark.fidelity
def test_ref2va_with_a_transformer_ref_adapter_is_bit_identical_to_diffusers(adapter_stack, client, tmp_path):
    picture = image(tmp_path / "ref.png", 48, 32, seed=3)
    req = request(
        ("refstyle", 1.5),
        prompt="<Picture 1> waves",
        num_inference_steps=3,
        params=common_pb2.GenerationParams(flow_shift=9.0),
    )
    req.references.add(asset_id=client.upload(picture).asset_id, kind=media_pb2.ASSET_KIND_IMAGE)
    served, resolved = served_and_resolved(client, tmp_path, req)
    assert (resolved.params.flow_shift, resolved.params.audio_flow_shift) == (9.0, 3.0)
    assert_same(served, reference(adapter_stack, resolved, references=(("image", str(picture)),)))


def test_the_dit_reports_its_adapters(adapter_stack):
    with grpc.insecure_channel(f"127.0.0.1:{adapter_stack.ports['dit']}") as channel:
        info = dit_pb2_grpc.DiTStub(channel).Info(common_pb2.InfoRequest())
    assert (info.adapter_mode, info.max_request_adapters) == ("unfused", 0)
    facts = {a.name: (tuple(a.partitions), a.rank, a.alpha, a.recommended_steps) for a in info.adapters}
    assert facts == {
        "refstyle": (("transformer_ref",), 2, 1.0, 0),
        "style": (("transformer",), 4, 2.0, 0),
        "turbo": (("transformer",), 4, 8.0, 3),
    }
    turbo = next(a for a in info.adapters if a.name == "turbo")
    assert (turbo.recommended_flow_shift, turbo.recommended_audio_flow_shift) == (6.0, 2.5)


@pytest.mark.parametrize(
    "named,fields,message",
    [
        ([("nope", 1.0)], {}, "adapters: unknown adapter 'nope'; this DiT loads refstyle, style, turbo"),
        (
            [("refstyle", 1.0)],
            {},
            "adapters: refstyle targets transformer_ref, not transformer, the partition t2va runs on",
        ),
        ([("turbo", -11.0)], {}, "adapters: turbo: weight must be within -10..10"),
        ([("turbo", 1.0), ("turbo", 1.0)], {}, "adapters: turbo is named twice"),
        ([], {"flow_shift": 0.0}, "flow_shift: must be a number with 0 < shift <= 100"),
        ([], {"audio_flow_shift": 250.0}, "audio_flow_shift: must be a number with 0 < shift <= 100"),
    ],
)
def test_the_gateway_refuses_bad_adapters_and_shifts(client, named, fields, message):
    req = request(*named)
    for key, value in fields.items():
        setattr(req.params, key, value)
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Submit(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(message), err.value.details()


def test_the_dit_refuses_an_unknown_adapter_at_its_boundary(adapter_stack):
    spec = dit_pb2.DenoiseSpec(
        height=32, width=64, num_frames=124, params=common_pb2.GenerationParams(num_inference_steps=2)
    )
    spec.params.adapters.add(name="nope", weight=1.0)
    with grpc.insecure_channel(f"127.0.0.1:{adapter_stack.ports['dit']}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(dit_pb2_grpc.DiTStub(channel).Denoise(iter([dit_pb2.DenoiseInput(spec=spec)])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "adapters: unknown adapter 'nope'; this DiT loads refstyle, style, turbo"


def test_the_adapters_are_part_of_the_idempotency_key_and_the_job_record(client):
    first = client.stub.Submit(request(("turbo", 1.0), request_id="lora-1"))
    again = client.stub.Submit(request(("turbo", 1.0), request_id="lora-1"))
    assert again.job_id == first.job_id
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Submit(request(("style", 1.0), request_id="lora-1"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    record = client.job(first.job_id).request.params
    assert ([(a.name, a.weight) for a in record.adapters], record.num_inference_steps, record.flow_shift) == (
        [("turbo", 1.0)],
        3,
        6.0,
    )
    client.stub.CancelJob(gateway_pb2.CancelJobRequest(job_id=first.job_id))


def test_the_gateway_and_its_http_door_list_the_dits_adapters(adapter_stack, client):
    """GatewayInfo and GET /v1/models (the console's adapter picker reads it), through the real openai SDK."""
    import openai

    with grpc.insecure_channel(adapter_stack.address("dit")) as channel:
        dit = dit_pb2_grpc.DiTStub(channel).Info(common_pb2.InfoRequest())
    info = client.stub.Info(common_pb2.InfoRequest())
    assert info.adapters_known and list(info.adapters) == list(dit.adapters) and info.max_request_adapters == 0
    sdk = openai.OpenAI(base_url=f"{adapter_stack.http}/v1", api_key="unused", max_retries=0)
    (model,) = sdk.models.list().data
    assert (model.id, model.owned_by) == ("minimax-h3", "h3serve")
    served = model.model_extra["h3serve"]
    assert (served["adapter_mode"], served["max_request_adapters"]) == ("unfused", 0)
    assert [(a["name"], a["rank"], a["alpha"], a["recommended_steps"]) for a in served["adapters"]] == [
        ("refstyle", 2, 1.0, 0),
        ("style", 4, 2.0, 0),
        ("turbo", 4, 8.0, 3),
    ]


def test_with_no_dit_serving_a_request_naming_adapters_is_unavailable(adapter_stack, client):
    """Last in this module: it stops the DiT (and starts it again for the session's other users of the stack).
    Nothing says which adapters exist then, so nothing can be resolved."""
    dit = next(item.process for item in adapter_stack.group.running if item.name == "dit")
    dit.send_signal(signal.SIGKILL)
    dit.wait(30)
    try:
        time.sleep(HEALTH_TTL_S + 0.1)  # past the cached Info answer
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Submit(request(("turbo", 1.0)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details().startswith("adapters: no DiT replica is serving now")
        job = client.stub.Submit(request(num_inference_steps=2))  # without adapters: accepted and queued, as before
        client.stub.CancelJob(gateway_pb2.CancelJobRequest(job_id=job.job_id))
    finally:
        adapter_stack.group.respawn("dit")
        adapter_stack.group.wait_healthy()
