"""`[dit] offload = "group"` (one 32 GB card): a compiled DiT under diffusers' group offload, its weights held once.

On the CPU, the streamed offload's hooks (h3serve/runtime/offload.py) run with both devices the CPU (no side
stream): what the compiled blocks meet from the hooks is the same. On a GPU (`-m gpu`), the served path itself:
weights readied in host memory (fp8 quantised there), pinned in arenas, streamed to the GPU, against the same
transformer moved whole to the GPU.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import Size, denoise_spec
from h3serve.runtime import compile_cache, offload, pinned
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.tiny import build_component
from h3serve.services.dit import parallel
from h3serve.services.dit.runner import DenoiseRunner, served

SIZE, FORWARDS, TOKENS = Size.parse("32x64x124"), 3, 12
ONE_RANK = parallel.Layout(world_size=1, ulysses_degree=1, ring_degree=1, fsdp=False)


def denoise(transformer: torch.nn.Module, device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    parts = {
        "transformer": transformer,
        "scheduler": build_component("scheduler"),
        "audio_scheduler": build_component("audio_scheduler"),
    }
    embeds = torch.randn(1, TOKENS, transformer.config.text_dim, generator=torch.Generator().manual_seed(0))
    runner = DenoiseRunner(parts, served(["t2va"]), device=device)
    return runner.run(
        denoise_spec(SIZE, forwards=FORWARDS), embeds, torch.ones(TOKENS, dtype=torch.int64), lambda step, total: None
    )


def test_compiled_blocks_run_under_group_offload_hooks_and_give_the_same_latents():
    # compiling each block's whole call took diffusers' hooks into the graph, and compile refuses to trace their
    # copies (torch._dynamo.exc.Unsupported: Skip inlining `torch.compiler.disable()`d function ... onload_)
    fast, cpu = FastPath(compile=True, dynamic=True), torch.device("cpu")
    torch._dynamo.reset()
    resident = build_component("transformer")
    parallel.prepare_transformer(resident, ONE_RANK, fast, cpu, torch.float32)
    expected = denoise(resident)
    offloaded = build_component("transformer")
    parallel.prepare_transformer(offloaded, ONE_RANK, fast, cpu, torch.float32)
    offload.stream_from_host(offloaded, cpu, use_stream=False)
    graphs = compile_cache.compiled_graphs()
    got = denoise(offloaded)
    assert compile_cache.compiled_graphs() == graphs, "the hooks around the blocks change nothing compiled"
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def host_copies(model: torch.nn.Module) -> list[torch.Tensor]:
    """What diffusers' group offload copies each weight from (a torchao weight: its fp8 data)."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    hooks = [m._diffusers_hook.get_hook(_GROUP_OFFLOADING) for m in model.modules() if hasattr(m, "_diffusers_hook")]
    return [getattr(t, "qdata", t) for hook in hooks if hook is not None for t in hook.group.cpu_param_dict.values()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "fast",
    [FastPath(compile=True, dynamic=True), FastPath(compile=True, dynamic=True, fp8=True)],
    ids=lambda f: f.describe(),
)
def test_group_offload_on_a_gpu_gives_the_resident_latents_from_one_host_copy(fast):
    gpu = torch.device("cuda", torch.cuda.current_device())
    torch._dynamo.reset()
    resident, offloaded = (build_component("transformer").to(torch.bfloat16) for _ in range(2))
    for transformer in (resident, offloaded):  # both readied in host memory, as rank.load_whole does with offload
        parallel.prepare_transformer(transformer, ONE_RANK, fast, gpu, torch.bfloat16)
    expected = denoise(resident.to(gpu), gpu)
    arenas = parallel.offload_groups(offloaded, gpu)
    got = denoise(offloaded, gpu)
    for name, tensor in expected.items():
        assert torch.equal(got[name].cpu(), tensor.cpu()), name
    copies = host_copies(offloaded)
    arena_storages = {arena.untyped_storage().data_ptr() for arena in arenas.arenas}
    assert copies and {copy.untyped_storage().data_ptr() for copy in copies} <= arena_storages, "no second copy"
    assert all(copy.device.type == "cpu" and copy.is_pinned() for copy in copies)


def test_weights_pack_into_arenas_with_their_values_shapes_and_strides(monkeypatch):
    monkeypatch.setattr(pinned, "ARENA_BYTES", 1 << 16)
    model = build_component("transformer")
    model.register_buffer("transposed", torch.arange(12.0).reshape(3, 4).t())  # strides (1, 4)
    before = {name: (t.clone(), t.stride()) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    arenas = pinned.pin_in_place(model, pinned.Arenas(pin=False))
    storages = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        values, stride = before[name]
        assert torch.equal(tensor, values) and tensor.stride() == stride, name
        storages.add(tensor.untyped_storage().data_ptr())
    spans = [-(-pinned.span_bytes(values) // pinned.ALIGN) * pinned.ALIGN for values, _ in before.values()]
    assert sum(spans) > 2 * pinned.ARENA_BYTES, "the test packs several arenas"
    assert len(storages) == arenas.count <= sum(spans) // pinned.ARENA_BYTES + 2, "a few full arenas, no copies"


def test_the_runner_puts_the_latents_where_it_computes_not_where_the_weights_are():
    # diffusers infers the execution device from the first model's weights: FSDP2 shards kept in host memory say
    # the CPU while the blocks run on a GPU. The runner's device is the one its pipelines use.
    parts = {
        "transformer": build_component("transformer"),
        "scheduler": build_component("scheduler"),
        "audio_scheduler": build_component("audio_scheduler"),
    }
    elsewhere = torch.device("meta")
    runner = DenoiseRunner(parts, served(["t2va", "fl2va"]), device=elsewhere)
    assert runner.device == elsewhere and [p._execution_device for p in runner.pipes.values()] == [elsewhere] * 2
    plain = DenoiseRunner(parts, served(["t2va"]))
    assert [p._execution_device for p in plain.pipes.values()] == [torch.device("cpu")], "the weights' device"
