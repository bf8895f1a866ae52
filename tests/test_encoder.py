"""The encoder's exact embedding cache: byte bound, LRU order, immutability, and hits that run no model."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from h3serve.common.config import EncoderConfig
from h3serve.runtime import wire
from h3serve.runtime.models import ModelSource
from h3serve.services.encoder.cache import ByteLRU
from h3serve.services.encoder.runner import COMPONENTS, TextEncoderRunner
from h3serve.services.encoder.server import EncoderServicer
from h3serve.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc


def test_eviction_keeps_the_byte_bound_in_lru_order():
    cache = ByteLRU(100)
    cache.put(("r", "a"), "A", 40)
    cache.put(("r", "b"), "B", 40)
    assert cache.get(("r", "a")) == "A"  # a is now the most recently used
    cache.put(("r", "c"), "C", 40)
    stats = cache.stats()
    assert cache.get(("r", "b")) is None and cache.get(("r", "a")) == "A" and cache.get(("r", "c")) == "C"
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 80, 1)


def test_a_value_larger_than_the_bound_is_not_kept():
    cache = ByteLRU(100)
    cache.put(("r", "a"), "A", 60)
    cache.put(("r", "huge"), "H", 101)
    assert cache.get(("r", "huge")) is None and cache.get(("r", "a")) == "A"
    assert cache.stats().bytes == 60


@pytest.fixture(scope="module")
def encoder():
    model = common_pb2.ModelInfo(model_revision="tiny-v1")
    servicer = EncoderServicer(
        TextEncoderRunner(ModelSource(None).load(COMPONENTS, "cpu", "float32")),
        model,
        EncoderConfig(cache_bytes=10_000, max_prompt_chars=100, max_prompt_tokens=80),
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield encoder_pb2_grpc.EncoderStub(channel)
    server.stop(None)


def encode(stub, prompt):
    replies = list(stub.Encode(encoder_pb2.EncodeRequest(prompt=prompt)))
    tensors = wire.decode([r.chunk for r in replies[:-1]], "prompt_embeds", "text_token_tags")
    return tensors, replies[-1].summary


def test_a_hit_runs_no_model_and_returns_the_same_tensors(encoder):
    first, miss = encode(encoder, "a quiet harbour at dawn")
    runs = encoder.Info(common_pb2.InfoRequest()).model_runs
    original = first["prompt_embeds"].clone()
    first["prompt_embeds"].add_(1.0)  # a caller mutating what it got must not change the cache
    again, hit = encode(encoder, "a quiet harbour at dawn")
    assert (miss.cache_hit, hit.cache_hit) == (False, True)
    assert encoder.Info(common_pb2.InfoRequest()).model_runs == runs
    assert torch.equal(again["prompt_embeds"], original)
    assert again["text_token_tags"].tolist() == [1] * again["text_token_tags"].numel()


def test_eviction_in_the_service_respects_its_byte_bound(encoder):
    for i in range(40):
        encode(encoder, f"prompt number {i} with some extra words to take room")
    info = encoder.Info(common_pb2.InfoRequest())
    assert info.cache_bytes <= info.cache_capacity_bytes == 10_000
    assert info.cache_evictions > 0


@pytest.mark.parametrize(
    "prompt,needle",
    [
        ("", "must not be blank"),
        ("x" * 101, "at most 100 characters"),
        ("\U0001f98a" * 21, "prompt: at most 80 tokens, got 84 (max_prompt_tokens)"),  # 21 characters of 4 bytes
    ],
)
def test_bad_prompts_are_refused_before_any_model_runs(encoder, prompt, needle):
    runs = encoder.Info(common_pb2.InfoRequest()).model_runs
    with pytest.raises(grpc.RpcError) as err:
        encode(encoder, prompt)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
    assert encoder.Info(common_pb2.InfoRequest()).model_runs == runs


@pytest.mark.parametrize("job_id", ["j" * 129, "has space", "tab\t", "\u00e9"])
def test_a_job_id_that_is_no_id_is_refused_without_echoing_it(encoder, job_id):
    with pytest.raises(grpc.RpcError) as err:
        list(encoder.Encode(encoder_pb2.EncodeRequest(prompt="a fox", job_id=job_id)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        f"job_id: at most 128 printable ASCII characters without spaces, got {len(job_id)} characters"
    )


def test_a_loaded_encoder_drops_the_layers_and_head_the_pipeline_never_reads(tmp_path):
    """A model directory whose Qwen3-VL has 54 decoder layers (the released one: 64) loads with 51 and no head,
    and encodes exactly what the whole model encodes (the pipeline reads hidden_states[50])."""
    from transformers import Qwen3VLForConditionalGeneration

    from h3serve.model import presets
    from h3serve.runtime import tiny

    tokenizer = presets.tiny_tokenizer()
    tiny.seeded("text_encoder")
    whole = Qwen3VLForConditionalGeneration(
        tiny.qwen3_vl_config(
            tokenizer, {**presets.TINY_TEXT_ENCODER_TEXT, "num_hidden_layers": 54}, presets.TINY_TEXT_ENCODER_VISION
        )
    ).eval()
    directory = tiny.write_tiny_model(tmp_path / "h3")
    whole.save_pretrained(directory / "text_encoder")
    parts = {name: tiny.build_component(name) for name in ("tokenizer", "processor")}
    expected = TextEncoderRunner({**parts, "text_encoder": whole}).encode("a heron lands", common_pb2.WORKFLOW_T2VA)

    loaded = ModelSource(str(directory)).load(["text_encoder"], "cpu", "float32")["text_encoder"]
    assert len(loaded.model.language_model.layers) == presets.TEXT_ENCODER_LAYERS == 51
    assert isinstance(loaded.lm_head, torch.nn.Identity)
    got = TextEncoderRunner({**parts, "text_encoder": loaded}).encode("a heron lands", common_pb2.WORKFLOW_T2VA)
    assert torch.equal(got["prompt_embeds"], expected["prompt_embeds"])
    assert torch.equal(got["text_token_tags"], expected["text_token_tags"])
