"""`[dit] offload = "group"` with `fp8_cache_dir` (the 32 GB profile): the fp8 store built block by block, its blocks
streamed from the memory-mapped files (h3serve/runtime/weight_stream.py), adapters over the cached fp8 base.

On the CPU the rank's own `load_whole` runs on the saved tiny model in bf16 with torchao's fp8 hardware check lifted
(its fp8 linear runs here), the stream's copies going to fresh host buffers instead of a GPU: the hooks, the
layout of the staging buffer and the swaps are the served ones.
"""

from __future__ import annotations

import logging

import pytest
import torch
from lora_files import original_lora
from test_fp8_store import ONE_RANK, assert_same, fp8_state, latents

from h3serve.common.config import DiTConfig
from h3serve.runtime import quantised_store, weight_stream
from h3serve.runtime.fastpath import FP8_LAYOUT as FP8
from h3serve.services.dit import rank

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return original_lora(tmp_path_factory.mktemp("lora") / "turbo.safetensors", 5, 4, 8.0, fused=False)


def start(model_dir, cache_dir, offload="group", **settings):
    config = DiTConfig(
        model_dir=str(model_dir),
        dtype="bfloat16",
        fp8=True,
        fp8_cache_dir=str(cache_dir),
        workflows=("t2va",),
        offload=offload,
        **settings,
    )
    components, _, held = rank.load_whole(config, ONE_RANK, CPU, ["transformer"])
    assert quantised_store.wait_for_saves(timeout_s=120)
    return components["transformer"], held


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file `tensor`'s memory is mapped from, by /proc/self/maps."""
    for line in open("/proc/self/maps").read().splitlines():
        span, *rest = line.split()
        low, high = (int(end, 16) for end in span.split("-"))
        if low <= tensor.data_ptr() < high:
            return rest[4] if len(rest) > 4 else None
    return None


def adapted_latents(transformer, held, name="turbo"):
    from h3serve.v1 import common_pb2

    held.apply("transformer", [common_pb2.Adapter(name=name, weight=1.0)])
    return latents(transformer)


def test_the_first_start_quantises_block_by_block_into_the_store_and_streams_what_a_resident_start_serves(
    fp8_on_cpu, loads, tiny_model_dir, tmp_path, caplog
):
    streamed, _ = start(tiny_model_dir, tmp_path)
    assert loads == [["scheduler", "audio_scheduler"]], "the bf16 transformer is never loaded whole"
    (saved,) = tmp_path.glob("transformer-fp8-*")
    assert (saved / "transformer_blocks.0.pt").is_file() and not list(tmp_path.glob("*.partial-*"))
    weight = streamed.transformer_blocks[0].attn.to_q.weight
    assert mapped_file(weight.qdata) == str(saved / "transformer_blocks.0.pt"), (
        "between forwards a block's weights are the mapped file's"
    )
    resident, _ = start(tiny_model_dir, tmp_path, offload="none")  # the same store, assigned and kept whole
    assert loads[-1] == ["scheduler", "audio_scheduler"]
    with caplog.at_level(logging.WARNING, logger="h3serve.weight_stream"):
        assert_same(latents(streamed), latents(resident))
    assert_same(fp8_state(streamed), fp8_state(resident)), "a forward leaves the weights where they were"
    stream = streamed.weight_stream
    assert 0 < stream.peak_live <= weight_stream.LIVE_BLOCKS and "given back" not in caplog.text, (
        "every block's buffer is given back and counted out: the copy thread never waits for a lost one"
    )


def test_adapters_run_over_the_cached_fp8_weights_and_a_warm_start_serves_the_cold_one_s_output(
    fp8_on_cpu, loads, tiny_model_dir, tmp_path, adapter
):
    cold, cold_held = start(tiny_model_dir, tmp_path, adapters={"turbo": str(adapter)})
    expected = adapted_latents(cold, cold_held)
    store = set(tmp_path.glob("transformer-fp8-*"))
    warm, warm_held = start(tiny_model_dir, tmp_path, adapters={"turbo": str(adapter)})
    assert set(tmp_path.glob("transformer-fp8-*")) == store and loads[-1] == ["scheduler", "audio_scheduler"], (
        "the restart with adapters assigns the cached weights"
    )
    assert_same(adapted_latents(warm, warm_held), expected)
    plain, _ = start(tiny_model_dir, tmp_path)
    assert set(tmp_path.glob("transformer-fp8-*")) == store, "one cache whatever the adapters"
    assert any(not torch.equal(tensor, expected[name]) for name, tensor in latents(plain).items()), (
        "the adapter changes the output"
    )


def test_unfused_adapters_wrap_the_fp8_linears_and_keep_their_factors_in_bf16(
    fp8_on_cpu, tiny_model_dir, tmp_path, adapter
):
    transformer, _ = start(tiny_model_dir, tmp_path, adapters={"turbo": str(adapter)})
    layers = [
        m
        for name, m in transformer.named_modules()
        if name.startswith("transformer_blocks.") and hasattr(m, "base_layer")
    ]
    assert layers and all(type(layer.base_layer.weight).__name__ == "Float8Tensor" for layer in layers)
    factors = [p for layer in layers for n, p in layer.named_parameters() if n.startswith("lora_")]
    assert factors and all(p.dtype == torch.bfloat16 for p in factors)


def test_a_stream_copy_that_fails_fails_the_forward_with_the_block_named(
    fp8_on_cpu, tiny_model_dir, tmp_path, monkeypatch
):
    transformer, _ = start(tiny_model_dir, tmp_path)

    def broken(self, index, onload, slot):
        raise OSError("Input/output error")

    copy = weight_stream.BlockStream._copy
    monkeypatch.setattr(weight_stream.BlockStream, "_copy", broken)
    with pytest.raises(RuntimeError, match="block 0's weights could not be streamed") as failure:
        latents(transformer)
    assert "Input/output error" in str(failure.value.__cause__)
    monkeypatch.setattr(weight_stream.BlockStream, "_copy", copy)
    resident, _ = start(tiny_model_dir, tmp_path, offload="none")
    assert_same(latents(transformer), latents(resident)), "the next request streams again: nothing stays broken"


def gpu_latents(transformer: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    from bench.common import Size, denoise_spec
    from h3serve.runtime.tiny import build_component
    from h3serve.services.dit.runner import DenoiseRunner, served

    parts = {
        "transformer": transformer,
        "scheduler": build_component("scheduler"),
        "audio_scheduler": build_component("audio_scheduler"),
    }
    embeds = torch.randn(1, 12, transformer.config.text_dim, generator=torch.Generator().manual_seed(0))
    runner = DenoiseRunner(parts, served(["t2va"]), device=device)
    out = runner.run(
        denoise_spec(Size.parse("32x64x124"), forwards=3),
        embeds.to(torch.bfloat16),
        torch.ones(12, dtype=torch.int64),
        lambda step, total: None,
    )
    return {name: tensor.cpu() for name, tensor in out.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_streamed_blocks_give_the_resident_latents_request_after_request(tiny_model_dir, tmp_path):
    """Pinned staging, the side stream and its events against the same fp8 store moved whole to the GPU; twice, since
    the second request starts from the blocks the first one's last forward prefetched."""
    gpu = torch.device("cuda", torch.cuda.current_device())

    def load(offload: str) -> torch.nn.Module:
        config = DiTConfig(
            model_dir=str(tiny_model_dir),
            dtype="bfloat16",
            fp8=True,
            fp8_cache_dir=str(tmp_path),
            workflows=("t2va",),
            offload=offload,
            device="cuda",
        )
        return rank.load_whole(config, ONE_RANK, gpu, ["transformer"])[0]["transformer"]

    streamed = load("group")
    expected = gpu_latents(load("none"), gpu)
    for _ in range(2):
        assert_same(gpu_latents(streamed, gpu), expected)
    assert streamed.transformer_blocks[0].attn.to_q.weight.qdata.device.type == "cpu", "back in host memory"


def test_a_resident_start_moves_the_stored_weights_out_of_the_files_through_the_staging_slots(
    fp8_on_cpu, tiny_model_dir, tmp_path, monkeypatch
):
    """weight_stream.move_to_device (a resident start from the fp8 store) with the CPU as the device and slots the
    size of its largest tensor, so that the tiny transformer crosses in several loads of each slot: every tensor
    leaves the store's mapped files, each torchao weight a new one over its moved parts, and the model denoises as it
    did from the files."""
    from h3serve.runtime.models import ModelSource

    start(tiny_model_dir, tmp_path, offload="none")  # fills the store
    store = quantised_store.QuantisedStore(tmp_path, ModelSource(str(tiny_model_dir)).revision(), torch.bfloat16, FP8)
    mapped = store.load(
        "transformer", rank.skeleton_of(ModelSource(str(tiny_model_dir)), "transformer", torch.bfloat16)
    )
    assert mapped is not None and mapped_file(mapped.transformer_blocks[0].attn.to_q.weight.qdata)
    expected_state = {name: tensor.clone() for name, tensor in fp8_state(mapped).items()}
    expected = latents(mapped)
    loads = []
    groups = weight_stream._slot_groups
    monkeypatch.setattr(weight_stream, "UPLOAD_SLOT_BYTES", 1 << 16)
    monkeypatch.setattr(weight_stream, "_slot_groups", lambda *a: loads.append(groups(*a)) or loads[-1])
    weight_stream.move_to_device(mapped, CPU)
    assert len(loads[0]) > 1, "several slot loads, each slot reused"
    state = fp8_state(mapped)
    stored = [name for name, tensor in state.items() if str(mapped_file(tensor)).startswith(str(tmp_path))]
    assert stored == [], "nothing left in the store's mapped files"
    assert_same(state, expected_state)
    assert_same(latents(mapped), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_resident_gpu_start_from_the_fp8_store_denoises_as_the_start_that_quantised(tiny_model_dir, tmp_path):
    """The served path on a GPU: the first start quantises on the card and saves; the restart assigns the files and
    moves them through the pinned slots (move_to_device): torchao weights that say they are on the card, the same
    fp8 bytes and latents."""
    gpu = torch.device("cuda", torch.cuda.current_device())
    config = DiTConfig(
        model_dir=str(tiny_model_dir), dtype="bfloat16", fp8=True, fp8_cache_dir=str(tmp_path), workflows=("t2va",)
    )
    first = rank.load_whole(config, ONE_RANK, gpu, ["transformer"])[0]["transformer"]
    assert quantised_store.wait_for_saves(timeout_s=120)
    again = rank.load_whole(config, ONE_RANK, gpu, ["transformer"])[0]["transformer"]
    weight = again.transformer_blocks[0].attn.to_q.weight
    assert weight.device.type == "cuda" and weight.qdata.device.type == "cuda" and mapped_file(weight.qdata) is None
    assert all(tensor.device.type == "cuda" for tensor in fp8_state(again).values())
    assert_same({k: v.cpu() for k, v in fp8_state(again).items()}, {k: v.cpu() for k, v in fp8_state(first).items()})
    assert_same(latents(again, gpu), latents(first, gpu))
