"""A quantized, spread text encoder built layer by layer from the model directory (services/encoder/placement.py
`build_spread`), so that the 4 x 22 GB profile's start never holds the bf16 encoder in host memory.

spread itself needs 2 GPUs; here the device map puts every part on the CPU, which runs the same build: each decoder
layer filled from the safetensors files on its device and quantized there before the next.
"""

from __future__ import annotations

import pytest
import torch

from h3serve.common.config import EncoderConfig
from h3serve.runtime import tiny
from h3serve.runtime.models import ModelSource
from h3serve.services.encoder import placement
from h3serve.services.encoder.runner import TextEncoderRunner
from h3serve.v1 import common_pb2

pytest.importorskip("torchao")
CPU = torch.device("cpu")


def embed(text_encoder) -> torch.Tensor:
    parts = {"tokenizer": tiny.build_component("tokenizer"), "processor": tiny.build_component("processor")}
    runner = TextEncoderRunner({"text_encoder": text_encoder, **parts})
    return runner.encode("a lighthouse in fog, a horn sounding twice", common_pb2.WORKFLOW_T2VA)["prompt_embeds"]


def test_a_spread_quantized_encoder_is_built_layer_by_layer_and_embeds_as_the_whole_load_quantized(tiny_model_dir):
    config = EncoderConfig(model_dir=str(tiny_model_dir), device="cuda", quantize="int8", spread=True)
    weights = placement.layer_weights(config)
    assert weights is not None, "spread with a quantization builds from the files"
    assert placement.layer_weights(config.replace(quantize="none")) is None, "bf16 spread is placed whole"
    whole = ModelSource(str(tiny_model_dir)).load(["text_encoder"], "cpu", "float32")["text_encoder"]
    placement.quantize_in_place(whole, "int8", torch.float32, CPU)

    layered = placement.skeleton(weights, torch.float32)
    filled: list[str] = []
    devices = {"": CPU, "model.language_model.layers.0": CPU}  # a part of its own, as accelerate's maps have

    def quantize(layer: torch.nn.Module) -> None:
        assert not any(p.is_meta for p in layer.parameters()), "the layer is filled before it is quantized"
        filled.append(str(sum(p.is_meta for p in layered.parameters())))  # the rest still unfilled meanwhile
        placement.quantize_layer(layer, "int8", torch.float32)

    placement.build_spread(layered, devices, weights, quantize)
    layers = len(layered.model.language_model.layers)
    assert len(filled) == layers and int(filled[0]) > int(filled[-1]) > 0, "one layer at a time, the rest after"
    assert not any(p.is_meta for p in layered.parameters())
    assert torch.equal(embed(layered), embed(whole))
