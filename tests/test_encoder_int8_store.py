"""`[encoder] int8_cache_dir`: the int8 encoder quantized layer by layer into the quantised store at the first start,
assigned from its memory-mapped files at later ones (h3serve/services/encoder/placement.py, `from_store`).

cpu_offload and spread need CUDA, so a deployment refuses them here; the functions they run take the CPU as the
device, as tests/test_encoder_placement.py runs the layer-by-layer build."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import ValidationError
from test_encoder_placement import embed, fl2va_embeds, in_arenas

from h3serve.common.config import EncoderConfig
from h3serve.runtime import tiny
from h3serve.services.encoder import placement

pytest.importorskip("torchao")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def text_parts():
    return {"tokenizer": tiny.build_component("tokenizer"), "processor": tiny.build_component("processor")}


def stored_config(model_dir, cache_dir) -> EncoderConfig:
    """The one-H100 profile's encoder settings over a model directory, with the CPU as the device (see above)."""
    config = EncoderConfig(
        model_dir=str(model_dir),
        device="cuda",
        dtype="float32",
        quantize="int8",
        cpu_offload=True,
        int8_cache_dir=str(cache_dir),
    )
    return config.replace(device="cpu")


def from_store(config: EncoderConfig) -> torch.nn.Module:
    weights = placement.layer_weights(config.replace(device="cuda"))
    assert weights is not None
    store = placement.int8_store(config, "rev")
    assert store is not None
    return placement.from_store(store, weights, config)


@pytest.fixture(scope="module")
def quantized_without_store(tiny_model_dir, text_parts):
    """The embeddings of the encoder built layer by layer and quantized without the store (place's own path)."""
    config = EncoderConfig(model_dir=str(tiny_model_dir), device="cuda", quantize="int8", cpu_offload=True)
    weights = placement.layer_weights(config)
    encoder = placement.skeleton(weights, torch.float32)
    placement.quantize_through(encoder, "int8", CPU, weights)
    return embed(encoder, text_parts), fl2va_embeds(encoder, text_parts)


def test_a_restart_assigns_the_saved_int8_layers_and_embeds_as_the_encoder_quantized_without_the_store(
    tiny_model_dir, tmp_path, text_parts, quantized_without_store, monkeypatch, caplog
):
    """The first start writes a file per decoder layer and the rest; the restart quantizes nothing and reads no
    weight of the model directory; both embed (text and keyframe) exactly as the encoder quantized without the store,
    also once pinned and streamed by the offload's hooks."""
    config = stored_config(tiny_model_dir, tmp_path)
    first = from_store(config)
    [saved] = list(tmp_path.glob("text_encoder-int8-*"))
    layers = len(first.model.language_model.layers)
    assert sorted(p.name for p in saved.glob("*.pt")) == sorted(
        [*(f"model.language_model.layers.{i}.pt" for i in range(layers)), "rest.pt"]
    )
    text, keyframe = quantized_without_store
    assert torch.equal(embed(first, text_parts), text)

    def quantizing_again(*_args, **_kwargs):
        raise AssertionError("a restart quantized a layer")

    def reading_weights(*_args, **_kwargs):
        raise AssertionError("a restart read the model directory's weights")

    monkeypatch.setattr(placement, "quantize_layer", quantizing_again)
    monkeypatch.setattr(placement.QuantisedStore, "build", reading_weights)
    with caplog.at_level(logging.INFO, logger="h3serve.quantised_store"):
        again = from_store(config)
    assert "int8 weights assigned from" in caplog.text
    weights = [m.weight for name, m in again.named_modules() if placement.is_target(m, name)]
    assert weights and all(w.qdata.dtype == torch.int8 for w in weights), "the layers' linears are int8 as saved"
    arenas = placement.offload_to_host(again, CPU, use_stream=False)
    assert in_arenas([w.qdata for w in weights], arenas), "pinned out of the memory-mapped files"
    assert torch.equal(embed(again, text_parts), text)
    assert torch.equal(fl2va_embeds(again, text_parts), keyframe)


def test_a_layer_file_that_does_not_load_is_replaced_by_quantizing_again(
    tiny_model_dir, tmp_path, text_parts, quantized_without_store, caplog
):
    config = stored_config(tiny_model_dir, tmp_path)
    from_store(config)
    [saved] = list(tmp_path.glob("text_encoder-int8-*"))
    damaged = saved / "model.language_model.layers.3.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="h3serve.quantised_store"):
        encoder = from_store(config)
    assert f"{saved} does not load" in caplog.text and "deleted, quantising again" in caplog.text
    assert torch.equal(embed(encoder, text_parts), quantized_without_store[0])
    assert torch.load(damaged, weights_only=True), "written whole again"


def test_a_store_that_cannot_be_written_is_a_warning_and_the_encoder_is_quantized_without_it(
    tiny_model_dir, tmp_path, caplog
):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="h3serve.quantised_store"):
        assert from_store(stored_config(tiny_model_dir, blocked)) is None
    assert "int8 weights not saved" in caplog.text and "the next start quantises again" in caplog.text


def test_the_key_names_the_model_and_the_dtype_and_is_not_the_dit_s(tmp_path):
    from h3serve.runtime.fastpath import FP8_LAYOUT
    from h3serve.runtime.quantised_store import QuantisedStore

    config = EncoderConfig(model_dir="random:full", device="cuda", quantize="int8", spread=True, int8_cache_dir="c")
    store = placement.int8_store(config, "rev-a")
    assert store is not None and store.path("text_encoder").name.startswith("text_encoder-int8-")
    others = {
        placement.int8_store(config, "rev-b").path("text_encoder"),  # type: ignore[union-attr]
        placement.int8_store(config.replace(dtype="float16"), "rev-a").path("text_encoder"),  # type: ignore[union-attr]
        QuantisedStore(store.directory, "rev-a", store.dtype, FP8_LAYOUT).path("text_encoder"),
    }
    assert len(others | {store.path("text_encoder")}) == 4
    assert placement.int8_store(config.replace(int8_cache_dir=""), "rev-a") is None


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"quantize": "none", "cpu_offload": True}, 'it needs quantize = "int8"'),
        ({"quantize": "nf4", "spread": True}, 'it needs quantize = "int8"'),
        ({"quantize": "int8"}, "set one of them"),
    ],
)
def test_int8_cache_dir_is_refused_where_it_would_keep_nothing(settings, needle, tmp_path):
    fields = {"model_dir": "random:full", "device": "cuda", "int8_cache_dir": str(tmp_path), **settings}
    with pytest.raises(ValidationError, match="int8_cache_dir") as refused:
        EncoderConfig(**fields)
    assert needle in str(refused.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_offloaded_int8_encoder_from_the_store_embeds_as_the_one_quantized_without_it(tiny_model_dir, tmp_path):
    """The service's own load on a GPU: without the store, into it, from it, and with a store it cannot write; the
    same embeddings every time."""
    config = EncoderConfig(
        model_dir=str(tiny_model_dir), device="cuda", dtype="float32", quantize="int8", cpu_offload=True
    )
    embeddings = []
    blocked = tmp_path / "a-file"  # a store that cannot be written: quantized without it
    blocked.write_text("not a directory")
    stores = [str(tmp_path / "int8"), str(tmp_path / "int8"), str(blocked)]
    for settings in ({}, *({"int8_cache_dir": store} for store in stores)):
        components, model = placement.load(config.replace(**settings), ["text_encoder", "tokenizer", "processor"])
        assert model.device == "cuda (weights in host memory, cpu_offload)"
        parts = {name: components[name] for name in ("tokenizer", "processor")}
        embeddings.append(embed(components["text_encoder"], parts).cpu())
    assert list((tmp_path / "int8").glob("text_encoder-int8-*")), "saved"
    assert all(torch.equal(other, embeddings[0]) for other in embeddings[1:])
