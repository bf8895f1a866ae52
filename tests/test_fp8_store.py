"""`[dit] fp8_cache_dir`: fp8 weights quantised at the first start, assigned from the file at later ones.

torchao refuses fp8 on a CPU only by a hardware check (its fp8 linear runs on the CPU); with that check lifted, the
DiT rank's own `load_whole` runs here on the saved tiny model in bf16, as a GPU rank runs it on the released one.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from bench.common import Size, denoise_spec
from h3serve.common.config import DiTConfig
from h3serve.runtime import pinned, quantised_store
from h3serve.runtime.fastpath import FP8_LAYOUT
from h3serve.runtime.models import ModelSource
from h3serve.services.dit import parallel, rank
from h3serve.services.dit.runner import DenoiseRunner, served

pytestmark = pytest.mark.processes

CPU, ONE_RANK = torch.device("cpu"), parallel.Layout(world_size=1, ulysses_degree=1, ring_degree=1, fsdp=False)
TOKENS = 12


def start(model_dir, cache_dir) -> torch.nn.Module:
    config = DiTConfig(
        model_dir=str(model_dir), dtype="bfloat16", fp8=True, fp8_cache_dir=str(cache_dir), workflows=("t2va",)
    )
    components, model, _ = rank.load_whole(config, ONE_RANK, CPU, ["transformer"])
    assert "transformer" in model.components
    assert quantised_store.wait_for_saves(timeout_s=120)
    return components["transformer"]


def fp8_state(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the transformer, a torchao weight as its fp8 data and scales."""
    state = {}
    for name, tensor in transformer.state_dict().items():
        for part in pinned.parts(tensor) or [""]:
            state[f"{name}.{part}" if part else name] = getattr(tensor, part) if part else tensor
    return state


def latents(transformer: torch.nn.Module, device: torch.device = CPU) -> dict[str, torch.Tensor]:
    from h3serve.runtime.tiny import build_component

    parts = {
        "transformer": transformer,
        "scheduler": build_component("scheduler"),
        "audio_scheduler": build_component("audio_scheduler"),
    }
    embeds = torch.randn(1, TOKENS, transformer.config.text_dim, generator=torch.Generator().manual_seed(0))
    runner = DenoiseRunner(parts, served(["t2va"]), device=device)
    return runner.run(
        denoise_spec(Size.parse("32x64x124"), forwards=2),
        embeds.to(torch.bfloat16),
        torch.ones(TOKENS, dtype=torch.int64),
        lambda step, total: None,
    )


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_restart_assigns_the_saved_fp8_weights_and_denoises_the_same(fp8_on_cpu, loads, tiny_model_dir, tmp_path):
    first = start(tiny_model_dir, tmp_path)
    quantised = [name for name, module in first.named_modules() if pinned.parts(getattr(module, "weight", None))]
    assert quantised and all(name.startswith("transformer_blocks.") for name in quantised)
    saved = list(tmp_path.glob("transformer-fp8-*"))
    assert len(saved) == 1 and not list(tmp_path.glob("*.partial-*"))
    blocks = len(first.transformer_blocks)
    assert sorted(f.name for f in saved[0].iterdir()) == sorted(
        ["rest.pt", *(f"transformer_blocks.{i}.pt" for i in range(blocks))]
    ), "a file per block, one for the rest"

    second = start(tiny_model_dir, tmp_path)
    assert loads == [["transformer", "scheduler", "audio_scheduler"], ["scheduler", "audio_scheduler"]], (
        "the restart neither loads nor quantises the bf16 transformer"
    )
    assert_same(fp8_state(second), fp8_state(first))
    assert all(tensor.device.type == "cpu" for tensor in fp8_state(second).values())
    assert_same(latents(second), latents(first))


def test_a_file_that_does_not_load_is_replaced_by_quantising_again(fp8_on_cpu, loads, tiny_model_dir, tmp_path, caplog):
    expected = fp8_state(start(tiny_model_dir, tmp_path))
    (saved,) = tmp_path.glob("transformer-fp8-*")
    block = saved / "transformer_blocks.1.pt"
    block.write_bytes(block.read_bytes()[: block.stat().st_size // 2])  # a truncated file
    with caplog.at_level(logging.WARNING, logger="h3serve.quantised_store"):
        again = start(tiny_model_dir, tmp_path)
    assert "does not load" in caplog.text and "quantising again" in caplog.text
    assert loads[-1] == ["transformer", "scheduler", "audio_scheduler"]
    assert_same(fp8_state(again), expected)
    assert_same(fp8_state(start(tiny_model_dir, tmp_path)), expected)  # and saved whole again
    assert loads[-1] == ["scheduler", "audio_scheduler"]


# A DiT start in a process of its own, fp8 on the CPU as fp8_on_cpu allows it, whose writer pauses after each block
# file (so a kill lands mid-save however fast the tiny model writes) and says where it writes.
SLOW_SAVE = """
import sys, time, torch
from torchao.quantization import quant_api
from h3serve.runtime import quantised_store
sys.path.insert(0, sys.argv[3])
from test_fp8_store import start
quant_api._check_hardware_support = lambda granularity: None
save = torch.save
def paused(state, path):
    save(state, path)
    print(path, flush=True)
    time.sleep(60)
quantised_store.torch.save = paused
start(sys.argv[1], sys.argv[2])
"""


def test_a_start_killed_while_it_saves_leaves_nothing_a_restart_loads(fp8_on_cpu, loads, tiny_model_dir, tmp_path):
    """SIGKILL while the first start writes its block files: they sit in a partial directory of the dead process,
    which no start loads; the restart quantises again, deletes the partial, saves whole and gives the weights an
    unbroken start gives."""
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_SAVE, str(tiny_model_dir), str(tmp_path / "cache"), os.path.dirname(__file__)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        written = child.stdout.readline().strip()  # the first block file is on disk, the rest are not
        assert ".partial-" in written, written
    finally:
        child.kill()
        child.wait()
    cache = tmp_path / "cache"
    assert [p.name for p in cache.iterdir()] == [Path(written).parent.name], "only the dead save's partial directory"
    assert Path(written).parent.name.endswith(f".partial-{child.pid}")

    restarted = start(tiny_model_dir, cache)
    assert loads == [["transformer", "scheduler", "audio_scheduler"]], "nothing saved to load: quantised again"
    (saved,) = cache.iterdir()
    assert saved.name.startswith("transformer-fp8-") and ".partial-" not in saved.name, "partial deleted, saved whole"
    assert_same(fp8_state(restarted), fp8_state(start(tiny_model_dir, tmp_path / "unbroken")))


def test_the_start_goes_on_while_the_served_weights_are_written(
    fp8_on_cpu, loads, tiny_model_dir, tmp_path, monkeypatch
):
    """One rank without sharding writes the weights it serves on a thread: the start returns before the file is
    written, and what is written is what the first start serves."""
    release, save = threading.Event(), torch.save

    def held_save(state, path):
        assert release.wait(60), "the start waited for the save"
        save(state, path)

    monkeypatch.setattr(torch, "save", held_save)
    config = DiTConfig(
        model_dir=str(tiny_model_dir), dtype="bfloat16", fp8=True, fp8_cache_dir=str(tmp_path), workflows=("t2va",)
    )
    first = rank.load_whole(config, ONE_RANK, CPU, ["transformer"])[0]["transformer"]
    assert not list(tmp_path.glob("transformer-fp8-????????????????")) and not quantised_store.wait_for_saves(
        timeout_s=0
    )
    release.set()
    assert quantised_store.wait_for_saves(timeout_s=120)
    assert len(list(tmp_path.glob("transformer-fp8-*"))) == 1 and not list(tmp_path.glob("*.partial-*"))
    assert_same(fp8_state(start(tiny_model_dir, tmp_path)), fp8_state(first))
    assert loads[-1] == ["scheduler", "audio_scheduler"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_background_save_copies_from_the_gpu_what_the_stream_queued_before_it(tmp_path):
    """The side stream waits for the current one: weights a kernel is still writing are saved as it leaves them."""
    module = torch.nn.Linear(4096, 4096, device="cuda")
    with torch.no_grad():
        for _ in range(20):  # queued work the save must wait for
            module.weight.mul_(1.0001).add_(0.5)
    store = quantised_store.QuantisedStore(tmp_path, "rev", torch.bfloat16, FP8_LAYOUT)
    store.save_later("transformer", module)
    assert quantised_store.wait_for_saves(timeout_s=120)
    saved = torch.load(store.path("transformer") / "rest.pt", weights_only=True)
    assert torch.equal(saved["weight"], module.weight.cpu()) and torch.equal(saved["bias"], module.bias.cpu())


def test_a_save_that_fails_is_a_warning_not_a_failed_start(fp8_on_cpu, tiny_model_dir, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="h3serve.quantised_store"):
        transformer = start(tiny_model_dir, blocked)
    assert "not saved" in caplog.text and "the next start quantises again" in caplog.text
    assert any(pinned.parts(tensor) for tensor in transformer.state_dict().values()), "served in fp8 all the same"


def test_the_key_names_the_weights_partition_dtype_and_versions(tmp_path, monkeypatch):
    import torchao

    store = quantised_store.QuantisedStore(tmp_path, "rev-a", torch.bfloat16, FP8_LAYOUT)
    path = store.path("transformer")
    others = [
        quantised_store.QuantisedStore(tmp_path, "rev-b", torch.bfloat16, FP8_LAYOUT).path("transformer"),
        store.path("transformer_ref"),
        quantised_store.QuantisedStore(tmp_path, "rev-a", torch.float32, FP8_LAYOUT).path("transformer"),
    ]
    monkeypatch.setattr(torchao, "__version__", "0.0.1")
    others.append(store.path("transformer"))
    assert len({path, *others}) == 5 and all(p.parent == tmp_path for p in others)
    assert ModelSource("random:full").revision() != ModelSource(None).revision()


def test_a_save_deletes_what_dead_saves_left_and_keeps_a_running_ones(tmp_path):
    store = quantised_store.QuantisedStore(tmp_path, "rev", torch.bfloat16, FP8_LAYOUT)
    path = store.path("transformer")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = path.with_name(f"{path.name}.partial-{int(dead.stdout)}")
    live = path.with_name(f"{path.name}.partial-{os.getppid()}")
    for partial in (stale, live):
        partial.mkdir()
        (partial / "transformer_blocks.0.pt").write_bytes(b"half a file")
    assert quantised_store.saves_in_flight(tmp_path) == [live]  # what the e2e bench waits for before it stops the DiT
    store.save("transformer", torch.nn.Linear(2, 2))
    assert (path / "rest.pt").is_file() and not stale.exists() and live.exists()


@pytest.mark.parametrize(
    "settings, reason",
    [
        (dict(fp8_cache_dir="var/fp8"), "it needs fp8 = true"),
        (
            dict(
                fp8=True,
                dtype="bfloat16",
                fp8_cache_dir="var/fp8",
                adapters={"a": "a.safetensors"},
                adapter_mode="fused",
            ),
            "a fused adapter is merged into the weights before quantisation",
        ),
    ],
)
def test_fp8_cache_dir_is_refused_where_it_would_do_nothing_or_the_wrong_thing(settings, reason, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=reason):
        DiTConfig(**settings)


def test_the_block_by_block_build_frees_each_block_although_its_quantised_weights_sit_in_cycles(tiny_model_dir):
    """torchao's quantised weights sit in reference cycles: left to the cyclic collector (which seldom runs while
    blocks are built), they filled a 14 GiB cap on one H200 by the eleventh block."""
    import gc
    import weakref

    from h3serve.runtime import random_full

    def quantize_in_a_cycle(block: torch.nn.Module, prefix: str) -> None:
        for module in block.modules():
            if isinstance(module, torch.nn.Linear):
                module.cycle = [module]  # as torchao's weights are: only the cyclic collector frees them

    weights = ModelSource(str(tiny_model_dir)).weights("transformer")
    model = random_full.skeleton(weights.factory, torch.bfloat16).requires_grad_(False)
    build = quantised_store.Build(weights, lambda: model, CPU, quantize_in_a_cycle)
    built: list[weakref.ref] = []
    gc.disable()
    try:
        for name, _state in quantised_store._quantised_groups(model, FP8_LAYOUT.blocks, build):
            alive = [ref for ref in built if ref() is not None]
            assert not alive, f"{len(alive)} earlier block(s) still held when {name} is handed over"
            if name != quantised_store.REST:
                linears = [m for m in model.transformer_blocks[len(built)].modules() if isinstance(m, torch.nn.Linear)]
                built.append(weakref.ref(linears.pop().weight))
                del linears
    finally:
        gc.enable()
    assert len(built) == len(model.transformer_blocks) > 1
