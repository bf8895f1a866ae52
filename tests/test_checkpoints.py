"""`[dit] transformer_file`: the checkpoints users already have (the published single-file layout and GGUFs of it),
written here from the tiny model (bench/checkpoint_files.py) and served by the DiT rank's own load path."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from lora_files import diffusers_lora

from bench.checkpoint_files import stream_gguf, to_published, truncated, write_gguf, write_single_file
from bench.common import Size, denoise_spec
from h3serve.common.config import ConfigError, DiTConfig, load_deploy
from h3serve.runtime import checkpoints, offload
from h3serve.runtime.models import ModelSource, own_memory
from h3serve.services.dit import config_check, parallel, rank
from h3serve.services.dit.adapters import Adapters
from h3serve.services.dit.runner import DenoiseRunner
from h3serve.services.dit.runner import served as served_flows

CPU, ONE_RANK = torch.device("cpu"), parallel.Layout(world_size=1, ulysses_degree=1, ring_degree=1, fsdp=False)
TOKENS = 12
# Relative L2 of the latents against the unquantised weights' (fp32, 2 denoise steps at 32x64x124 on the tiny model),
# measured 2.75e-3 (Q8_0) and 4.75e-2 (Q4_0); the bounds leave 3.6x and 2.1x room
GGUF_BOUNDS = {"Q8_0": 0.01, "Q4_0": 0.1}


@pytest.fixture(scope="module")
def files(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    single = write_single_file(tiny_model_dir, root / "h3.safetensors")
    return {"single": single, **{kind: write_gguf(single, root / f"h3-{kind}.gguf", kind) for kind in GGUF_BOUNDS}}


def served_transformer(model_dir, dtype: str, transformer_file: str = "", **options) -> torch.nn.Module:
    """The transformer as a DiT rank loads it (rank.load_whole), after the start-up check passed."""
    return served(model_dir, dtype, transformer_file, **options)[0]


def served(model_dir, dtype: str, transformer_file: str = "", **options) -> tuple[torch.nn.Module, Adapters]:
    """The transformer and its adapters as a DiT rank loads them, after the start-up check passed."""
    config = DiTConfig(
        model_dir=str(model_dir), dtype=dtype, workflows=("t2va",), transformer_file=transformer_file, **options
    )
    config_check.check(config)
    components, model, held = rank.load_whole(config, ONE_RANK, CPU, ["transformer"])
    assert "transformer" in model.components
    return components["transformer"], held


def latents(
    transformer: torch.nn.Module, dtype: torch.dtype, held: Adapters | None = None, adapters: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    from h3serve.runtime.tiny import build_component

    parts = {
        "transformer": transformer,
        "scheduler": build_component("scheduler"),
        "audio_scheduler": build_component("audio_scheduler"),
    }
    embeds = torch.randn(1, TOKENS, transformer.config.text_dim, generator=torch.Generator().manual_seed(0))
    runner = DenoiseRunner(parts, served_flows(["t2va"]), held, device=CPU)
    spec = denoise_spec(Size.parse("32x64x124"), forwards=2)
    for name in adapters:
        spec.params.adapters.add(name=name, weight=1.0)
    return runner.run(
        spec,
        embeds.to(dtype),
        torch.ones(TOKENS, dtype=torch.int64),
        lambda step, total: None,
    )


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def relative_l2(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(float((got[k].float() - v.float()).norm() / v.float().norm()) for k, v in expected.items())


def test_the_written_file_is_the_inverse_of_diffusers_conversion(tiny_model_dir, files):
    """diffusers' own converter turns the written file back into the released weights, every tensor exactly."""
    from diffusers import MiniMaxH3Transformer3DModel as Transformer
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    released = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    published = load_file(files["single"])
    assert checkpoints.DETECTION_KEY in published and not any("to_q" in name for name in published)
    back = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        dict(published), config=Transformer.load_config(str(tiny_model_dir / "transformer")), qkv_layout="stacked"
    )
    assert back.keys() == released.keys()
    for name, tensor in released.items():
        assert torch.equal(back[name], tensor), name
    assert to_published(released).keys() == published.keys()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_dit_serves_the_single_file_as_the_released_layout(tiny_model_dir, files, dtype):
    torch_dtype = getattr(torch, dtype)
    from_file = served_transformer(tiny_model_dir, dtype, str(files["single"]))
    released = served_transformer(tiny_model_dir, dtype)
    assert {n: t.dtype for n, t in from_file.state_dict().items()} == {
        n: t.dtype for n, t in released.state_dict().items()
    }, "the fp32 modules stay fp32, as from_pretrained"
    assert_same(latents(from_file, torch_dtype), latents(released, torch_dtype))


def test_the_dit_serves_what_diffusers_from_single_file_gives(tiny_model_dir, files):
    """In float32 diffusers' from_single_file, in process, and the DiT agree bit for bit (memory of its own for both:
    CPU BLAS picks its code path by pointer alignment, models.own_memory). In bfloat16 from_single_file alone casts
    the `_keep_in_fp32_modules` to bf16; the DiT keeps them fp32 (the test above), as the released layout does."""
    from diffusers import MiniMaxH3Transformer3DModel as Transformer

    plain = Transformer.from_single_file(
        str(files["single"]), config=str(tiny_model_dir), subfolder="transformer", local_files_only=True
    )
    own_memory(plain)
    assert_same(
        latents(served_transformer(tiny_model_dir, "float32", str(files["single"])), torch.float32),
        latents(plain, torch.float32),
    )


@pytest.mark.parametrize("kind", GGUF_BOUNDS)
def test_a_gguf_denoises_within_its_bound(tiny_model_dir, files, kind):
    from diffusers import GGUFQuantizationConfig
    from diffusers import MiniMaxH3Transformer3DModel as Transformer
    from diffusers.quantizers.gguf.utils import GGUFLinear

    served_gguf = served_transformer(tiny_model_dir, "float32", str(files[kind]))
    assert any(isinstance(module, GGUFLinear) for module in served_gguf.modules()), "kept quantised"
    got = latents(served_gguf, torch.float32)
    plain = Transformer.from_single_file(
        str(files[kind]),
        config=str(tiny_model_dir),
        subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
    )
    own_memory(plain)
    assert_same(got, latents(plain, torch.float32))
    error = relative_l2(got, latents(served_transformer(tiny_model_dir, "float32"), torch.float32))
    print(f"{kind}: relative L2 of the latents against the unquantised weights {error:.3e}")
    assert 0 < error <= GGUF_BOUNDS[kind]


@pytest.mark.parametrize("kind", GGUF_BOUNDS)
def test_the_streamed_gguf_holds_what_write_gguf_writes(tiny_model_dir, files, kind, tmp_path):
    """bench.gguf_step's writer (from diffusers' weights, quantised by torch, one tensor at a time) writes write_gguf's
    tensors byte for byte, and checkpoints.load makes the same transformer of both files."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    state = load_file(tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    streamed = stream_gguf(state, tmp_path / f"streamed-{kind}.gguf", kind)

    def tensors(path: Path) -> dict[str, tuple]:
        return {t.name: (t.tensor_type.name, t.shape.tolist(), t.data.tobytes()) for t in GGUFReader(path).tensors}

    assert tensors(streamed) == tensors(files[kind])
    checkpoints.check(streamed, str(tiny_model_dir))
    assert_same(
        latents(checkpoints.load(streamed, str(tiny_model_dir), torch.float32), torch.float32),
        latents(checkpoints.load(files[kind], str(tiny_model_dir), torch.float32), torch.float32),
    )


def test_the_revision_follows_the_file(tiny_model_dir, files, tmp_path):
    copy = tmp_path / "h3.safetensors"
    copy.write_bytes(files["single"].read_bytes())
    released = ModelSource(str(tiny_model_dir)).revision()
    first = ModelSource(str(tiny_model_dir), str(copy)).revision()
    assert first != released and first == ModelSource(str(tiny_model_dir), str(copy)).revision()
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert ModelSource(str(tiny_model_dir), str(copy)).revision() != first, "a rewritten file is another revision"


def test_the_benchmarks_random_full_source_takes_a_file_against_the_released_config(files):
    """`[model] dir = "random:full"` (bench.e2e --transformer-file): the file is checked against the released
    transformer, the one random_full builds, and its weights are another revision."""
    from h3serve.model import presets
    from h3serve.runtime import random_full

    built = random_full.build_component("transformer", "meta", torch.bfloat16)
    assert {n: t.shape for n, t in checkpoints.skeleton(presets.RANDOM_FULL).state_dict().items()} == {
        n: t.shape for n, t in built.state_dict().items()
    }
    with_file = ModelSource(presets.RANDOM_FULL, str(files["Q8_0"]))
    assert with_file.revision() != ModelSource(presets.RANDOM_FULL).revision() and with_file.from_file("transformer")
    assert DiTConfig(model_dir=presets.RANDOM_FULL, transformer_file=str(files["Q8_0"])).transformer_file


def refusal(model_dir, path, **options) -> str:
    """The start-up check's one line; nothing was loaded (rank.load_whole never ran)."""
    with pytest.raises(ValueError) as refused:
        config_check.check(
            DiTConfig(model_dir=str(model_dir), workflows=("t2va",), transformer_file=str(path), **options)
        )
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"transformer_file {str(path)!r}: ")
    return message


def test_each_unloadable_file_is_refused_naming_it_and_why(tiny_model_dir, files, tmp_path):
    from safetensors.torch import load_file, save_file

    assert "no such file" in refusal(tiny_model_dir, tmp_path / "absent.gguf")
    cut = truncated(files["single"], tmp_path / "cut.safetensors")
    assert "not a .safetensors file" in refusal(tiny_model_dir, cut)
    assert "not a .gguf file" in refusal(tiny_model_dir, truncated(files["Q8_0"], tmp_path / "cut.gguf"))
    other = tmp_path / "other.safetensors"
    save_file({"model.diffusion_model.x.weight": torch.zeros(2, 2)}, other)
    assert "unknown layout" in refusal(tiny_model_dir, other)
    pruned = write_single_file(
        tiny_model_dir, tmp_path / "pruned.safetensors", extra={"adaln_t_table": torch.zeros(4, 8)}
    )
    assert "This is a pruned MiniMax-H3 checkpoint" in refusal(tiny_model_dir, pruned), "diffusers' own words"
    state = load_file(files["single"])
    state["blocks.0.mlp.fc2.weight"] = torch.zeros(32, 16)
    save_file(state, tmp_path / "wrong.safetensors")
    assert (
        "has wrong shapes: blocks.0.mlp.fc2.weight [32, 16] (it becomes transformer_blocks.0.ff.net.2.weight must "
        "be [32, 64])"
    ) in refusal(tiny_model_dir, tmp_path / "wrong.safetensors"), "the file's own name, and diffusers' it becomes"
    del state["blocks.1.mlp.fc2.weight"]
    save_file(state, tmp_path / "short.safetensors")
    assert "it lacks blocks.1.mlp.fc2.weight" in refusal(tiny_model_dir, tmp_path / "short.safetensors"), (
        "the file's name"
    )


def test_a_gguf_of_another_transformer_is_refused(tiny_model_dir, files, tmp_path):
    """A GGUF whose tensors do not fit: the tiny model with another width, quantised."""
    from safetensors.torch import load_file, save_file

    state = {
        name: torch.cat([tensor, tensor]) if name.endswith("mlp.fc2.weight") else tensor
        for name, tensor in load_file(files["single"]).items()
    }
    save_file(state, tmp_path / "wide.safetensors")
    gguf = write_gguf(tmp_path / "wide.safetensors", tmp_path / "wide.gguf", "Q8_0")
    message = refusal(tiny_model_dir, gguf)
    assert "has wrong shapes:" in message
    assert (
        "blocks.1.mlp.fc2.weight [64, 64] (it becomes transformer_blocks.1.ff.net.2.weight must be [32, 64])" in message
    )


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"fp8": True, "dtype": "bfloat16"}, "fp8 = true cannot re-quantise them"),
        ({"compile": True}, "compile = true is untested"),
        ({"adapters": {"turbo": "ADAPTER"}, "adapter_mode": "fused"}, 'adapter_mode = "fused" cannot merge'),
    ],
)
def test_gguf_refuses_the_fast_path_options_that_cannot_apply(tiny_model_dir, files, options, reason, tmp_path):
    if "adapters" in options:
        options = {**options, "adapters": {"turbo": str(diffusers_lora(tmp_path / "turbo", 1, 4, 8.0))}}
    assert f"a GGUF's weights stay quantised, so {reason}" in refusal(tiny_model_dir, files["Q8_0"], **options)


def test_a_gguf_streamed_by_group_offload_gives_the_resident_latents(tiny_model_dir, files):
    """Group offload's hooks (on the CPU: both devices the CPU, no side stream, as tests/test_group_offload.py) move
    the GGUF parameters' quantised bytes; the linears keep dequantising them as they run. The served path streams to
    a GPU (`offload = "group"` is refused on a CPU rank): BENCHMARKS.md's single-24gb-gguf.toml rows."""
    from diffusers.quantizers.gguf.utils import GGUFParameter

    expected = latents(served_transformer(tiny_model_dir, "float32", str(files["Q4_0"])), torch.float32)
    streamed = served_transformer(tiny_model_dir, "float32", str(files["Q4_0"]))
    offload.stream_from_host(streamed, CPU, use_stream=False)
    quantised = [p for p in streamed.parameters() if isinstance(p, GGUFParameter) and p.quant_type.name == "Q4_0"]
    assert quantised and all(p.dtype == torch.uint8 for p in quantised), "moved as the file's quantised bytes"
    assert_same(latents(streamed, torch.float32), expected)


def test_a_gguf_serves_an_unfused_adapter_as_diffusers_loads_it(tiny_model_dir, files, tmp_path):
    """The DiT's adapter (a peft LoRA layer around each targeted GGUF linear) against diffusers' own load of the same
    file into the same GGUF transformer in process; a request without it runs the bare GGUF."""
    from diffusers import GGUFQuantizationConfig
    from diffusers import MiniMaxH3Transformer3DModel as Transformer
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin as Loader
    from diffusers.quantizers.gguf.utils import GGUFLinear
    from peft.tuners.lora import LoraLayer

    path = diffusers_lora(tmp_path / "turbo", 1, 4, 8.0)
    transformer, held = served(tiny_model_dir, "float32", str(files["Q4_0"]), adapters={"turbo": str(path)})
    wrapped = [m.base_layer for n, m in transformer.named_modules() if isinstance(m, LoraLayer) and "blocks." in n]
    assert wrapped and all(isinstance(layer, GGUFLinear) for layer in wrapped), "the blocks' linears stay quantised"
    got = latents(transformer, torch.float32, held, ("turbo",))
    bare = latents(transformer, torch.float32, held)

    plain = Transformer.from_single_file(
        str(files["Q4_0"]),
        config=str(tiny_model_dir),
        subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
    )
    own_memory(plain)
    expected_bare = latents(plain, torch.float32)
    state, metadata = Loader.lora_state_dict(str(path), return_lora_metadata=True)
    plain.load_lora_adapter(state, prefix="transformer", adapter_name="turbo", metadata=metadata)
    assert_same(got, latents(plain, torch.float32))
    assert_same(bare, expected_bare)
    assert relative_l2(got, bare) > 1e-3, "the adapter changes what the GGUF computes"


def test_the_fp8_store_is_refused_with_any_file(tiny_model_dir, files, tmp_path):
    assert "fp8_cache_dir saves and streams" in refusal(
        tiny_model_dir, files["single"], dtype="bfloat16", fp8=True, fp8_cache_dir=str(tmp_path)
    )


def test_the_key_needs_a_model_dir_and_a_known_suffix(tmp_path):
    for text, expected in (
        ('[dit]\ntransformer_file = "/x/h3.gguf"\n', "come from [model] dir"),
        ('[model]\ndir = "/m"\n[dit]\ntransformer_file = "/x/h3.ckpt"\n', ".safetensors or .gguf"),
    ):
        path = tmp_path / "deploy.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_deploy(path)
    path.write_text('[model]\ndir = "/m"\n[dit]\ntransformer_file = "/absent/h3-Q4_0.gguf"\n')
    assert load_deploy(path).dit.transformer_file == "/absent/h3-Q4_0.gguf", "a missing file is the DiT's to refuse"


def test_a_wrong_stacked_qkv_is_named_by_the_files_key_once(tiny_model_dir, files, tmp_path):
    """The published layout stacks q, k and v in one tensor that diffusers' converter splits in three: the refusal
    names the file's tensor (what its owner can find in it), once, with the three it would become."""
    from safetensors.torch import load_file, save_file

    state = load_file(files["single"])
    rows, columns = state["blocks.1.attn.qkv_proj.weight"].shape
    state["blocks.1.attn.qkv_proj.weight"] = torch.zeros(rows * 2, columns)
    save_file(state, tmp_path / "wide-qkv.safetensors")
    message = refusal(tiny_model_dir, tmp_path / "wide-qkv.safetensors")
    assert f"has wrong shapes: blocks.1.attn.qkv_proj.weight [{rows * 2}, {columns}] (it becomes " in message
    assert message.count("blocks.1.attn.qkv_proj.weight") == 1
    for part in ("to_q", "to_k", "to_v"):
        assert f"transformer_blocks.1.attn.{part}.weight must be [{rows // 3}, {columns}]" in message


def test_the_start_log_names_the_weight_file_it_loads(tiny_model_dir, files, caplog):
    caplog.set_level("INFO", logger="h3serve.runtime.checkpoints")
    served_transformer(tiny_model_dir, "float32", str(files["Q8_0"]))
    size = files["Q8_0"].stat().st_size
    assert f"loading the transformer from {files['Q8_0'].resolve()} ({size / 1024:.1f} KiB, gguf)" in caplog.messages
