"""The text encoder on small GPUs (h3serve/services/encoder/placement.py): int8 within its documented error, the
embedding cache keyed by the encoder variant, placements refused where they cannot work, offload and spread."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from h3serve.common.config import EncoderConfig
from h3serve.runtime import tiny, wire
from h3serve.services.encoder import placement
from h3serve.services.encoder import server as encoder_server
from h3serve.services.encoder.cache import ByteLRU, prompt_key
from h3serve.services.encoder.runner import COMPONENTS, TextEncoderRunner
from h3serve.services.encoder.server import EncoderServicer
from h3serve.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc

torchao = pytest.importorskip("torchao")

PROMPT = "a quiet harbour at dawn, gulls circling over fishing boats"


@pytest.fixture(scope="module")
def text_parts():
    """The tiny preset's tokenizer and processor (shared: placement never touches them)."""
    return {"tokenizer": tiny.build_component("tokenizer"), "processor": tiny.build_component("processor")}


def embed(text_encoder, text_parts, prompt=PROMPT) -> torch.Tensor:
    runner = TextEncoderRunner({"text_encoder": text_encoder, **text_parts})
    return runner.encode(prompt, common_pb2.WORKFLOW_T2VA)["prompt_embeds"].clone()


@pytest.fixture(scope="module")
def reference(text_parts) -> torch.Tensor:
    return embed(tiny.build_component("text_encoder"), text_parts)


def test_int8_on_cpu_is_within_the_documented_error_and_really_quantized(text_parts, reference):
    from torchao.quantization import Int8Tensor

    encoder = tiny.build_component("text_encoder")
    where = placement.place(encoder, EncoderConfig(quantize="int8"))
    assert where == "cpu"
    quantized = {
        name for name, module in encoder.named_modules() if isinstance(getattr(module, "weight", None), Int8Tensor)
    }
    assert quantized == {name for name, module in encoder.named_modules() if placement.is_target(module, name)}
    assert len(quantized) == 51 * 7  # q, k, v, o, gate, up, down of every decoder layer
    assert not any(name.startswith(("model.visual", "lm_head", "model.language_model.embed")) for name in quantized)
    out = embed(encoder, text_parts)
    max_abs, rel = placement.embedding_error(out, reference)
    assert max_abs > 0 and rel > 0  # the quantization happened
    assert placement.INT8_BOUND.holds(out, reference), (max_abs, rel)
    assert rel < 0.02  # the tiny preset's own row of the docstring's table (measured 1.0e-2)


def test_variant_names_the_numbers():
    assert placement.variant(EncoderConfig()) == "fp32"
    assert placement.variant(EncoderConfig(dtype="bfloat16")) == "bf16"
    assert placement.variant(EncoderConfig(dtype="bfloat16", quantize="int8")) == "int8"
    assert placement.variant(EncoderConfig(dtype="bfloat16", quantize="nf4", device="cuda")) == "nf4"
    assert placement.variant(EncoderConfig(dtype="bfloat16", spread=True)) == "bf16"  # placement alone: same numbers
    assert prompt_key("r", "int8", "p") != prompt_key("r", "bf16", "p")


def serve_on_loopback(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, grpc.insecure_channel(f"127.0.0.1:{port}")


def encode(stub, prompt=PROMPT):
    replies = list(stub.Encode(encoder_pb2.EncodeRequest(prompt=prompt)))
    return wire.decode([r.chunk for r in replies[:-1]], "prompt_embeds", "text_token_tags"), replies[-1].summary


def test_the_cache_is_keyed_by_variant_through_the_real_services(reference):
    """An fp32 and an int8 encoder service (the real load path: tiny preset, placed) share one cache: the same prompt
    misses once per variant, then hits, and each hit returns its own variant's embeddings."""
    shared = ByteLRU(1 << 20)
    stubs, servers = {}, []
    for quantize in ("none", "int8"):
        config = EncoderConfig(quantize=quantize, cache_bytes=1 << 20)
        components, model = placement.load(config, COMPONENTS)
        server, channel = serve_on_loopback(EncoderServicer(TextEncoderRunner(components), model, config, shared))
        servers.append((server, channel))
        stubs[quantize] = encoder_pb2_grpc.EncoderStub(channel)
    try:
        plain, first = encode(stubs["none"])
        int8, second = encode(stubs["int8"])
        int8_again, third = encode(stubs["int8"])
        plain_again, fourth = encode(stubs["none"])
        assert [s.cache_hit for s in (first, second, third, fourth)] == [False, False, True, True]
        assert torch.equal(plain["prompt_embeds"], reference)
        assert not torch.equal(int8["prompt_embeds"], plain["prompt_embeds"])
        assert placement.INT8_BOUND.holds(int8["prompt_embeds"], plain["prompt_embeds"])
        assert torch.equal(int8_again["prompt_embeds"], int8["prompt_embeds"])
        assert torch.equal(plain_again["prompt_embeds"], plain["prompt_embeds"])
        assert (shared.stats().entries, shared.stats().hits, shared.stats().misses) == (2, 2, 2)
        info = stubs["int8"].Info(common_pb2.InfoRequest()).model
        assert (info.dtype, info.device) == ("float32 (int8 weights)", "cpu")
        assert info.model_revision == second.model_revision == first.model_revision  # the weights' revision
        assert stubs["none"].Info(common_pb2.InfoRequest()).model.dtype == "float32"
    finally:
        for server, channel in servers:
            channel.close()
            server.stop(None)


@pytest.mark.parametrize(
    "settings,needle",
    [
        ({"quantize": "nf4"}, 'quantize = "nf4" needs a CUDA device'),
        (
            {"spread": True},
            (
                "spread = true puts the text encoder's decoder layers on several GPUs: it needs device = "
                '"cuda" and at least 2 visible CUDA devices'
            ),
        ),
        ({"spread": True, "device": "cuda"}, "at least 2 visible CUDA devices"),
        (
            {"cpu_offload": True},
            (
                "cpu_offload = true keeps the weights in host memory and runs each layer on the GPU: "
                'it needs device = "cuda"'
            ),
        ),
        (
            {"cpu_offload": True, "quantize": "nf4", "device": "cuda"},
            'cpu_offload = true and quantize = "nf4" do not go',
        ),
        (
            {"cpu_offload": True, "quantize": "int8", "device": "cuda", "int8_cache_dir": "int8-cache"},
            "int8_cache_dir keeps an encoder built from [model] dir (or random:full) layer by layer: the tiny preset",
        ),
    ],
)
def test_placements_that_cannot_work_here_are_refused_at_start(monkeypatch, settings, needle):
    if torch.cuda.device_count() >= 2 and settings.get("spread") and settings.get("device") == "cuda":
        pytest.skip("this machine has the GPUs the refusal is about")
    config = EncoderConfig(**settings)
    with pytest.raises(ValueError) as err:
        placement.check(config)
    assert needle in str(err.value)
    monkeypatch.setattr(placement, "load", lambda *a: pytest.fail("weights loaded before the refusal"))
    with pytest.raises(SystemExit) as stop:
        encoder_server.serve(config)
    assert str(stop.value).startswith("h3serve serve encoder: ") and needle in str(stop.value)


def fl2va_embeds(text_encoder, text_parts) -> torch.Tensor:
    """A keyframe through the vision tower (fl2va), so offload is checked on the vision path too."""
    import numpy as np
    from PIL import Image

    from h3serve.model.workflows.base import PreparedMedia

    pixels = np.random.default_rng(0).integers(0, 256, (32, 64, 3), dtype=np.uint8)
    media = PreparedMedia({"keyframes": [Image.fromarray(pixels)]}, [])
    runner = TextEncoderRunner({"text_encoder": text_encoder, **text_parts})
    return runner.encode(PROMPT, common_pb2.WORKFLOW_FL2VA, media)["prompt_embeds"].clone()


def grouped(module: torch.nn.Module) -> set[str]:
    """The modules diffusers' group offload hooks (each one group, onloaded when it runs)."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    return {
        name
        for name, m in module.named_modules()
        if hasattr(m, "_diffusers_hook") and m._diffusers_hook.get_hook(_GROUP_OFFLOADING) is not None
    }


def in_arenas(tensors, arenas) -> bool:
    storages = {arena.untyped_storage().data_ptr() for arena in arenas.arenas}
    return {t.untyped_storage().data_ptr() for t in tensors} <= storages


def test_streamed_offload_groups_each_layer_holds_the_weights_once_and_keeps_the_embeddings(text_parts, reference):
    """The streamed offload's hooks with the CPU as the onload device and no stream (a deployment refuses
    cpu_offload on the CPU: it does nothing; this checks the grouping, that the weights are held once, in the
    arenas, and that the hooks keep the numbers, text and vision)."""
    vision_reference = fl2va_embeds(tiny.build_component("text_encoder"), text_parts)
    encoder = tiny.build_component("text_encoder")
    arenas = placement.offload_to_host(encoder, torch.device("cpu"), use_stream=False)
    blocks = {f"model.language_model.layers.{i}" for i in range(51)} | {
        "model.visual.blocks.0",
        "model.visual.blocks.1",
        "model.visual.deepstack_merger_list.0",
    }
    loose = {"model.language_model", "model.language_model.embed_tokens", "model.visual"}  # their other parts
    assert grouped(encoder) == blocks | loose, "one group per layer and vision block, none for the whole model"
    assert torch.equal(embed(encoder, text_parts), reference)
    assert torch.equal(fl2va_embeds(encoder, text_parts), vision_reference)
    assert vision_reference.shape[1] > reference.shape[1]  # the vision block's rows are in
    assert in_arenas([*encoder.model.parameters(), *encoder.model.buffers()], arenas), "no second copy"


def test_int8_quantized_layer_by_layer_for_the_offload_holds_int8_in_the_arenas_and_embeds_as_int8_does(text_parts):
    """int8 with cpu_offload: each decoder layer quantized on the device and brought back (here the CPU is both), then
    streamed from the arenas: the embeddings of the int8 encoder quantized whole, and only int8 data in host memory
    for the layers' linears."""
    resident = tiny.build_component("text_encoder")
    placement.quantize_in_place(resident, "int8", torch.float32, torch.device("cpu"))
    expected = embed(resident, text_parts)
    encoder = tiny.build_component("text_encoder")
    placement.quantize_through(encoder, "int8", torch.device("cpu"))
    arenas = placement.offload_to_host(encoder, torch.device("cpu"), use_stream=False)
    assert torch.equal(embed(encoder, text_parts), expected)
    weights = [m.weight for name, m in encoder.named_modules() if placement.is_target(m, name)]
    assert weights and all(w.qdata.dtype == torch.int8 for w in weights)
    assert in_arenas([w.qdata for w in weights], arenas), "the int8 data is what the arenas hold"


def test_a_model_directory_s_encoder_built_layer_by_layer_gives_the_encoder_loaded_whole(text_parts, tiny_model_dir):
    """int8 with cpu_offload never holds the bf16 encoder whole: a skeleton's decoder layers are filled one by one from
    the model directory's safetensors on the device, quantized and brought back, then the rest; the embeddings are
    those of the encoder loaded whole and quantized the same way."""
    from h3serve.runtime.models import ModelSource

    config = EncoderConfig(model_dir=str(tiny_model_dir), device="cuda", quantize="int8", cpu_offload=True)
    weights = placement.layer_weights(config)
    assert weights is not None and placement.layer_weights(config.replace(quantize="none")) is None
    whole = ModelSource(str(tiny_model_dir)).load(["text_encoder"], "cpu", "float32")["text_encoder"]
    placement.quantize_through(whole, "int8", torch.device("cpu"))
    layered = placement.skeleton(weights, torch.float32)
    assert all(p.is_meta for p in layered.parameters())
    placement.quantize_through(layered, "int8", torch.device("cpu"), weights)
    assert not any(p.is_meta for p in layered.parameters())
    assert torch.equal(embed(layered, text_parts), embed(whole, text_parts))


def test_spread_map_keeps_decoder_layers_whole_and_balances():
    encoder = tiny.build_component("text_encoder")
    size = sum(p.numel() * p.element_size() for p in encoder.parameters())
    device_map = placement.spread_map(encoder, {0: size, 1: size})
    assert set(device_map.values()) == {0, 1}
    for name in device_map:  # no entry below a decoder layer or a vision block
        parts = name.split(".")
        if name.startswith("model.language_model.layers."):
            assert len(parts) == 4, name
        if name.startswith("model.visual.blocks."):
            assert len(parts) == 4, name
    layers = [
        device_map.get(f"model.language_model.layers.{i}", device_map.get("model.language_model")) for i in range(51)
    ]
    assert layers.count(0) > 10 and layers.count(1) > 10  # balanced, not all on the first GPU
    with pytest.raises(ValueError, match="does not fit the 2 GPUs' free memory"):
        placement.spread_map(encoder, {0: size // 4, 1: size // 4})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantize", ["none", "int8", "nf4"])
def test_cuda_placements_from_the_cpu(text_parts, reference, quantize):
    if quantize == "nf4":
        pytest.importorskip("bitsandbytes")
    config = EncoderConfig(device="cuda", quantize=quantize, cpu_offload=quantize == "none")
    placement.check(config)
    encoder = tiny.build_component("text_encoder")  # on the CPU, as staged_on_cpu loads it
    assert placement.staged_on_cpu(config)
    placement.place(encoder, config)
    out = embed(encoder, text_parts).cpu()
    max_abs, rel = placement.embedding_error(out, reference)
    assert (
        rel < 1e-4 if quantize == "none" else 0 < rel <= (placement.INT8_BOUND.rel_l2 if quantize == "int8" else 0.3)
    ), (quantize, max_abs, rel)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_spread_over_two_gpus(text_parts, reference, quantize):
    config = EncoderConfig(device="cuda", spread=True, quantize=quantize)
    placement.check(config)
    encoder = tiny.build_component("text_encoder")
    where = placement.place(encoder, config)
    assert where == "cuda:0+cuda:1 (spread)"
    rel = placement.embedding_error(embed(encoder, text_parts).cpu(), reference)[1]
    assert rel < 1e-4 if quantize == "none" else 0 < rel <= placement.INT8_BOUND.rel_l2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_service_gives_the_card_back_what_an_encode_cached(reference):
    """As the DiT and the VAE do after every request, for a stage sharing the card (the plan counts an encoder between
    requests as its weights and context only): after an Encode over gRPC the process reserves less than the encode
    did, and the embeddings are the same."""
    config = EncoderConfig(device="cuda", cpu_offload=True, cache_bytes=0)
    components, model = placement.load(config, COMPONENTS)
    server, channel = serve_on_loopback(EncoderServicer(TextEncoderRunner(components), model, config))
    try:
        torch.cuda.reset_peak_memory_stats()
        embeddings, summary = encode(encoder_pb2_grpc.EncoderStub(channel))
        assert not summary.cache_hit
        assert torch.cuda.memory_reserved() < torch.cuda.max_memory_reserved()
        assert placement.embedding_error(embeddings["prompt_embeds"], reference)[1] < 1e-4
    finally:
        channel.close()
        server.stop(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_streamed_offload_on_a_gpu_gives_the_resident_embeddings(text_parts):
    """The served path in bf16: pinned in place, each layer streamed on a side stream, against the same encoder
    moved whole to the GPU; twice, since the first request traces the order the second prefetches in."""
    gpu = torch.device("cuda", torch.cuda.current_device())
    resident, offloaded = (tiny.build_component("text_encoder").to(torch.bfloat16) for _ in range(2))
    resident.to(gpu)
    expected = embed(resident, text_parts), fl2va_embeds(resident, text_parts)
    arenas = placement.offload_to_host(offloaded, gpu)
    for _ in range(2):
        got = embed(offloaded, text_parts), fl2va_embeds(offloaded, text_parts)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    streamed = [*offloaded.model.language_model.layers.parameters(), *offloaded.model.visual.blocks.parameters()]
    assert in_arenas(streamed, arenas) and all(t.is_pinned() for t in streamed), "back in the pinned arenas"
