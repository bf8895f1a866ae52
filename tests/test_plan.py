"""`h3serve plan`: per-GPU memory predicted from parameter counts, refusals with the numbers, the shipped small-GPU
profiles; the allocator cap's decision (h3serve/runtime/memory.py) without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3serve.common import memory_plan
from h3serve.common.config import load_deploy
from h3serve.common.memory_plan import GIB, TRANSFORMER, plan
from h3serve.runtime import memory

pytestmark = pytest.mark.processes

CLI = [sys.executable, "-m", "h3serve.cli", "plan"]
DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy"
PROFILES = ("turing-4x22.toml", "single-32gb.toml", "single-24gb.toml", "single-24gb-gguf.toml")


def _config(tmp_path: Path, text: str):
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    return path


def _dit_only(tmp_path: Path, dit: str, frames_canvas: str = ""):
    return load_deploy(
        _config(
            tmp_path,
            f'[model]\ndir = "/models/MiniMax-H3"\n{frames_canvas}\n'
            f'[dit]\ndevice = "cuda"\ndtype = "bfloat16"\nworkflows = ["t2va"]\n'
            f"{dit}\n",
        )
    )


def _rank0(result) -> memory_plan.Share:
    return next(share for gpu in result.gpus for share in gpu.shares if share.process == "dit rank 0")


@pytest.mark.parametrize("profile", PROFILES)
def test_the_small_gpu_profiles_load_and_fit(profile):
    config = load_deploy(DEPLOY / profile)
    assert all(config.service(name).memory_limit_gib > 0 for name in ("encoder", "dit", "vae"))
    # a host large enough that only the GPUs are under test here (tests/test_host_plan.py plans the host)
    out = subprocess.run(
        [*CLI, "--config", str(DEPLOY / profile), "--host-gib", "256"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.rstrip().endswith("fits") and "GPU 0:" in out.stdout


def test_turing_profile_places_what_the_brief_asks():
    config = load_deploy(DEPLOY / "turing-4x22.toml")
    assert (config.dit.world_size, config.dit.fsdp, config.dit.ulysses_degree) == (4, True, 4)
    assert (config.dit.attention_backend, config.dit.dtype) == ("sage", "bfloat16")
    result = plan(config)
    assert [gpu.gpu for gpu in result.gpus] == ["0", "1", "2", "3"]
    assert all(gpu.card == 21.5 and gpu.used <= gpu.card for gpu in result.gpus)
    single = load_deploy(DEPLOY / "single-32gb.toml")
    assert (single.dit.fp8, single.dit.compile, single.dit.offload) == (True, True, "group")


def test_the_turing_profile_fits_a_64_gib_host_with_int8_weights_resident_on_the_cards():
    config = load_deploy(DEPLOY / "turing-4x22.toml")
    assert (config.dit.linear_precision, config.dit.weights, config.dit.fsdp_offload) == ("fp16_scaled", "int8", False)
    out = subprocess.run(
        [*CLI, "--config", str(DEPLOY / "turing-4x22.toml"), "--host-gib", "64"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.rstrip().endswith("fits"), out.stdout + out.stderr
    result = plan(config, host_gib=64)
    rank = _rank0(result)
    assert rank.host == 0.0, "nothing of the DiT pinned in host memory"
    assert rank.weights == pytest.approx(TRANSFORMER.bytes("bfloat16", False, int8=True) / GIB / 4)
    assert 7.5 < rank.weights < 8.0, "a quarter of 31.7 GiB"
    usable = 64 - memory_plan.HOST_RESERVE_GIB
    assert max(result.host.total("start"), result.host.total("serving")) <= usable
    encoder = next(need for need in result.host.needs if need.service == "encoder")
    assert "bf16 load" not in encoder.start_parts, "the nf4 encoder is built layer by layer on its GPUs"


def test_the_fp16_path_and_sage_add_their_workspace_and_int8_weights_shrink_a_rank(tmp_path):
    base = 'gpus = "0,1,2,3"\nworld_size = 4\nfsdp = true\n'
    bf16 = _rank0(plan(_dit_only(tmp_path, base), gpu_gib=140))
    scaled = _rank0(plan(_dit_only(tmp_path, base + 'linear_precision = "fp16_scaled"\n'), gpu_gib=140))
    int8 = _rank0(plan(_dit_only(tmp_path, base + 'linear_precision = "fp16_scaled"\nweights = "int8"\n'), gpu_gib=140))
    sage = _rank0(plan(_dit_only(tmp_path, base + 'attention_backend = "sage"\n'), gpu_gib=140))
    assert scaled.activations == pytest.approx(bf16.activations * memory_plan.FP16_SCALED_ACT_FACTOR)
    assert int8.weights < bf16.weights / 1.9 and scaled.weights == bf16.weights
    widened = TRANSFORMER.largest_linear * 2 / GIB
    assert int8.transient == pytest.approx(
        bf16.transient
        - 2 * TRANSFORMER.block_bytes("bfloat16", False) / GIB
        + 2 * TRANSFORMER.block_bytes("bfloat16", False, int8=True) / GIB
        + widened
    )
    assert sage.activations > bf16.activations


def test_the_whole_bf16_dit_on_one_22_gib_card_is_refused_with_the_numbers(tmp_path):
    path = _config(
        tmp_path,
        '[dit]\ndevice = "cuda"\ngpus = "0"\ndtype = "bfloat16"\nworkflows = ["t2va"]\nmemory_limit_gib = 22\n',
    )
    out = subprocess.run(
        [*CLI, "--config", str(path), "--frames", "124", "--host-gib", "256"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("h3serve plan: GPU 0: dit rank 0") for line in lines), lines
    assert "weights 61.7" in lines[0] and "over its memory_limit_gib 22" in lines[0]
    assert "over the card's 22 GiB (memory_limit_gib)" in lines[1]
    assert "does not fit: 2 problem(s)" in out.stdout


def test_a_gpu_of_unknown_size_and_a_limit_above_the_card_are_refused(tmp_path):
    path = _config(tmp_path, '[vae]\ndevice = "cuda"\ngpus = "1"\n')
    out = subprocess.run([*CLI, "--config", str(path)], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "GPU 1: card size unknown (vae)" in out.stderr
    path = _config(tmp_path, '[vae]\ndevice = "cuda"\ngpus = "1"\nmemory_limit_gib = 48\n')
    out = subprocess.run(
        [*CLI, "--config", str(path), "--gpu-gib", "22"], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "memory_limit_gib = 48 GiB is above the card's total of 22.00 GiB" in out.stderr


def test_fsdp_over_4_ranks_holds_a_quarter_of_one_ranks_weights_and_fp8_is_smaller(tmp_path):
    whole = _rank0(plan(_dit_only(tmp_path, 'gpus = "0"'), gpu_gib=140))
    sharded = _rank0(plan(_dit_only(tmp_path, 'gpus = "0,1,2,3"\nworld_size = 4\nfsdp = true'), gpu_gib=140))
    replicated = _rank0(plan(_dit_only(tmp_path, 'gpus = "0,1,2,3"\nworld_size = 4'), gpu_gib=140))
    assert whole.weights == pytest.approx(61.73, abs=0.01)  # 33.12 B parameters in bf16, 17 M of them fp32
    assert sharded.weights == pytest.approx(whole.weights / 4)
    assert replicated.weights == whole.weights
    assert sharded.transient == pytest.approx(
        2 * TRANSFORMER.block * 2 / GIB + TRANSFORMER.fsdp_root_bytes("bfloat16") / GIB
    )  # two whole bf16 blocks and the root unit, gathered
    assert sharded.activations == replicated.activations < whole.activations  # a quarter of the rows (x 1.3)
    fp8 = _rank0(plan(_dit_only(tmp_path, 'gpus = "0"\nfp8 = true'), gpu_gib=140))
    assert whole.weights - fp8.weights == pytest.approx(TRANSFORMER.fp8_linears / GIB)  # one byte less each
    offloaded = _rank0(
        plan(_dit_only(tmp_path, 'gpus = "0,1,2,3"\nworld_size = 4\nfsdp = true\nfsdp_offload = true'), gpu_gib=140)
    )
    assert (offloaded.weights, offloaded.transient, offloaded.host) == (0.0, sharded.transient, sharded.weights)
    group = _rank0(plan(_dit_only(tmp_path, 'gpus = "0"\noffload = "group"'), gpu_gib=140))
    assert group.weights == 0 and group.host == whole.weights
    assert group.transient == pytest.approx(
        (TRANSFORMER.outside_blocks_bytes("bfloat16") + 2 * TRANSFORMER.block * 2) / GIB
    )  # all but the 50 blocks, and two blocks: 4.0 of 61.7 GiB


def test_the_encoder_placements(tmp_path):
    def encoder(text: str) -> list[memory_plan.Share]:
        config = load_deploy(_config(tmp_path, f'[encoder]\ndevice = "cuda"\ndtype = "bfloat16"\n{text}\n'))
        return [share for gpu in plan(config, gpu_gib=140).gpus for share in gpu.shares]

    (bf16,) = encoder('gpus = "0"')
    assert bf16.weights == pytest.approx(26_240_699_376 * 2 / GIB)  # 48.9 GiB
    (int8,), (nf4,) = encoder('gpus = "0"\nquantize = "int8"'), encoder('gpus = "0"\nquantize = "nf4"')
    assert nf4.weights < int8.weights < bf16.weights * 0.6
    spread = encoder('gpus = "0,1,2"\nspread = true\nquantize = "nf4"')
    assert [s.gpu for s in spread] == ["0", "1", "2"] and spread[0].weights == pytest.approx(nf4.weights / 3)
    (offloaded,) = encoder('gpus = "0"\ncpu_offload = true')
    assert offloaded.weights == 0 and offloaded.transient < 2.5 and offloaded.host == bf16.weights


def test_a_vae_spread_over_gpus_plans_a_decoder_replica_on_each_and_the_frames_on_the_first(tmp_path):
    def vae(text: str) -> list[memory_plan.Share]:
        config = load_deploy(_config(tmp_path, f'[vae]\ndevice = "cuda"\ndtype = "bfloat16"\n{text}\n'))
        return [share for gpu in plan(config, gpu_gib=140).gpus for share in gpu.shares]

    (alone,) = vae('gpus = "3"')
    first, replica = vae('gpus = "2,3"\ndecode_gpus = 2')
    assert (first.gpu, first.process, replica.gpu, replica.process) == ("2", "vae", "3", "vae decode replica")
    assert first.total == pytest.approx(alone.total)
    assert replica.weights < first.weights and replica.activations < first.activations  # no frames, no audio VAE
    (fp8,) = vae('gpus = "3"\nfp8 = true')
    assert alone.weights - fp8.weights == pytest.approx(memory_plan.VIDEO_VAE.fp8_linears / GIB)  # a byte each


def test_services_sharing_a_gpu_add_up(tmp_path):
    config = load_deploy(DEPLOY / "single-32gb.toml")
    (gpu,) = plan(config).gpus
    assert {share.process for share in gpu.shares} == {"dit rank 0", "encoder", "vae"}
    assert gpu.used == pytest.approx(sum(share.total for share in gpu.shares))


def test_the_32gb_profile_gives_each_process_its_share_of_the_card():
    """Caps at the whole card let one process's cache crowd out another's (the DiT's cold warm-up reserved 21.8 GiB for
    11.5 of tensors): the shipped shares add up to the card with their contexts, and each prediction within
    its own."""
    config = load_deploy(DEPLOY / "single-32gb.toml")
    (gpu,) = plan(config).gpus
    assert (gpu.card, gpu.card_source) == (31.5, "[supervisor] gpu_memory_gib")
    assert sum(share.limit + memory_plan.CONTEXT_GIB for share in gpu.shares) == pytest.approx(gpu.card)
    assert all(share.allocator <= share.limit for share in gpu.shares), [share.describe() for share in gpu.shares]
    assert not any("crowd out" in note for note in plan(config).notes)


def test_the_24gb_profile_plans_768x1344_as_turns_and_a_canvas_that_admits_no_clip_is_named(tmp_path):
    """Stages taking turns, the card holds one process at its peak and the others idle: 768x1344x124 fits there, and
    would not with every process at its peak at once; the VAE's weights are onloaded per request."""
    text = (DEPLOY / "single-24gb.toml").read_text()
    result = plan(load_deploy(DEPLOY / "single-24gb.toml"), canvas=(768, 1344), frames=124)
    (gpu,) = result.gpus
    assert gpu.turns and not result.problems and result.workload.rows > 39_000
    busiest = max(s.total + sum(o.idle for o in gpu.shares if o is not s) for s in gpu.shares)
    assert gpu.used == pytest.approx(busiest) and "idle" in gpu.breakdown()
    vae = next(share for share in gpu.shares if share.process == "vae")
    assert vae.weights == 0 and vae.host == vae.transient > 5, vae.describe()
    together = plan(load_deploy(_config(tmp_path, text.replace("stages_take_turns = true", ""))), canvas=(768, 1344))
    assert sum(s.total for s in together.gpus[0].shares) == pytest.approx(together.gpus[0].used)
    assert together.gpus[0].used > gpu.card
    assert any("over the card's 23.5 GiB" in problem for problem in together.problems)
    smaller = text.replace("max_rows = 42000", "max_rows = 16000")
    larger = plan(load_deploy(_config(tmp_path, smaller)), canvas=(768, 1344)).workload
    assert larger.frames == 0 and larger.bound.endswith(
        "0 frames fit it: every 768x1344 request is refused (--canvas plans another canvas)"
    )


def test_caps_that_add_up_over_the_card_are_named(tmp_path):
    text = (DEPLOY / "single-32gb.toml").read_text()
    for cap in ("3.75", "14.0", "12.25"):
        text = text.replace(f"memory_limit_gib = {cap} ", "memory_limit_gib = 31.5 ")
    result = plan(load_deploy(_config(tmp_path, text)))
    assert (
        "GPU 0: the memory_limit_gib caps of its processes add up to 96.0 GiB with their CUDA contexts, over the "
        "card's 31.5 GiB: a process's cached memory can crowd out another's"
    ) in " ".join(result.notes)
    assert not result.problems
    assert plan(load_deploy(_config(tmp_path, text)), gpu_gib=100).gpus[0].card_source == "--gpu-gib"


def test_predictions_cover_our_measured_peaks(tmp_path):
    """BENCHMARKS.md, peak allocated GiB on H200s at 768x1344x124 (t2va): the estimate is at or above each, by
    less than 10 % (fragmentation and context excluded: max_memory_allocated counts neither)."""
    canvas = "canvas_short_edge = 768\n"
    cases = [
        ('gpus = "0"', 68.3),  # 1 GPU, bf16 eager
        ('gpus = "0,1"\nworld_size = 2', 66.1),  # Ulysses 2, replicated
        ('gpus = "0,1"\nworld_size = 2\nfsdp = true', 37.7),  # Ulysses 2, FSDP2
        ('gpus = "0"\nfp8 = true\ncompile = true', 48.1),
    ]  # fp8 + compile
    for dit, measured in cases:
        share = _rank0(plan(_dit_only(tmp_path, dit, canvas), gpu_gib=140, frames=124))
        predicted = share.weights + share.transient + share.activations
        assert measured <= predicted <= measured * 1.10, (dit, predicted, measured)
    vae = load_deploy(_config(tmp_path, '[vae]\ndevice = "cuda"\ngpus = "0"\ndtype = "bfloat16"\n'))
    (share,) = plan(vae, gpu_gib=140, frames=124).gpus[0].shares
    assert share.weights + share.activations == pytest.approx(11.2, abs=0.1)  # the calibration point


def test_parameter_counts_match_the_classes_built_on_the_meta_device():
    """The plan's constants, counted again from diffusers' and transformers' classes (no memory allocated)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    from h3serve.model import presets
    from h3serve.runtime.fastpath import fp8_target
    from h3serve.runtime.models import drop_unread_parts
    from h3serve.runtime.random_full import text_encoder_factory

    def fp32(model):
        keep = set(model._keep_in_fp32_modules or ())
        return sum(p.numel() for name, p in model.named_parameters() if keep & set(name.split(".")))

    with torch.device("meta"):
        transformer = MiniMaxH3Transformer3DModel()
        vae, audio = AutoencoderKLMiniMaxH3(), AutoencoderKLMiniMaxH3Audio(**presets.RANDOM_FULL_AUDIO_VAE)
        encoder = drop_unread_parts({"text_encoder": text_encoder_factory(presets.tiny_tokenizer())()})["text_encoder"]
    count = memory_plan.TRANSFORMER
    assert sum(p.numel() for p in transformer.parameters()) == count.total
    assert fp32(transformer) == count.fp32
    assert len(transformer.transformer_blocks) == count.blocks
    assert sum(p.numel() for p in transformer.transformer_blocks[0].parameters()) == count.block
    assert sum(m.weight.numel() for name, m in transformer.named_modules() if fp8_target(m, name)) == count.fp8_linears
    units = [m for m in transformer.modules() if type(m).__name__ in transformer._no_split_modules]
    assert count.total - sum(p.numel() for m in units for p in m.parameters()) == count.fsdp_root
    block_linears = [m.weight for m in transformer.transformer_blocks.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(w.numel() for w in block_linears) == count.int8_linears, "weights = int8 holds these"
    assert sum(w.shape[0] for w in block_linears) == count.int8_rows, "an fp32 scale per output row"
    assert max(w.numel() for w in block_linears) == count.largest_linear
    for model, expected in ((vae, memory_plan.VIDEO_VAE), (audio, memory_plan.AUDIO_VAE)):
        assert (sum(p.numel() for p in model.parameters()), fp32(model)) == (expected.total, expected.fp32)
    quantised = sum(m.weight.numel() for name, m in vae.decoder.named_modules() if fp8_target(m, name))
    assert quantised == memory_plan.VIDEO_VAE.fp8_linears
    text = memory_plan.TEXT_ENCODER
    layers = encoder.model.language_model.layers
    assert (sum(p.numel() for p in encoder.parameters()), len(layers)) == (text.total, text.layers)
    assert sum(p.numel() for p in layers[0].parameters()) == text.layer

    def linears(module):
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))

    assert linears(layers) == text.layer_linears
    assert encoder.model.language_model.embed_tokens.weight.numel() == text.embedding


def test_the_limit_decision_without_a_gpu(monkeypatch):
    total = 22 * GIB - 300 * (1 << 20)  # what CUDA reports for a "22 GB" card, about
    assert memory_plan.limit_fraction(21.5, total) == pytest.approx(21.5 * GIB / total)
    with pytest.raises(
        ValueError,
        match=r"memory_limit_gib = 22 GiB is above the card's total of 21\.71 GiB "
        r"\(23,307,747,328 bytes\)",
    ):
        memory_plan.limit_fraction(22, total)

    class Properties:
        total_memory = total

    applied = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: applied.append((f, d)))
    config = load_deploy(DEPLOY / "turing-4x22.toml")
    memory.cap(config.vae, "cuda:0")
    assert applied == [(pytest.approx(21.5 * GIB / total), torch.device("cuda", 0))]
    with pytest.raises(memory.MemoryLimitError, match="cuda:1: memory_limit_gib = 22 GiB is above"):
        memory.cap(config.vae.replace(memory_limit_gib=22.0), "cuda:1")
    memory.cap(config.vae, "cpu")  # off CUDA: nothing to cap
    memory.cap(config.vae.replace(memory_limit_gib=0.0), "cuda:0")  # no limit
    assert len(applied) == 1
    memory.release("cpu")  # a no-op off CUDA
