"""The sharded DiT on 2 CPU ranks (gloo): every rank-level check in one torchrun launch (tests/dist_checks.py)."""

from __future__ import annotations

import json

import pytest
from forked import run_ranks

pytestmark = pytest.mark.processes

TOLERANCE = 1e-5  # fp32: the split changes only the order of floating-point sums


@pytest.fixture(scope="module")
def report(tmp_path_factory, fork_server) -> dict:
    """The ranks as forks of the session's fork server (forked.run_ranks), from the checkout's root."""
    out = tmp_path_factory.mktemp("dist") / "checks.json"
    run_ranks(fork_server, "tests.dist_checks", [str(out)])
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_two_ranks_give_the_one_rank_latents(report):
    expected = {
        f"{split} fsdp={fsdp} S={s}" for split in ("ulysses 2", "ring 2") for fsdp in (False, True) for s in (498, 499)
    }
    assert set(report["latents"]) == expected, "Ulysses and ring, FSDP on and off, even and odd packed length"
    for name, diff in report["latents"].items():
        assert diff <= TOLERANCE, f"{name}: max abs difference {diff}"
        assert report["applied"][name] == {"fsdp": "fsdp=True" in name, "context_parallel": True}, name


@pytest.mark.distributed
def test_cancel_stops_every_rank_at_the_same_step_and_the_group_serves_on(report):
    cancel = report["cancel"]
    assert cancel["cancelled"] and cancel["steps"] == [2, 2]
    assert cancel["steps_after"] == [6, 6], "the next request ran all 4 steps on both ranks"
    assert cancel["next_matches"] <= TOLERANCE


@pytest.mark.distributed
def test_fsdp_shards_bf16_blocks_next_to_fp32_pinned_modules(report):
    # production dtypes: FSDP2 accepts the mix and the result agrees to bf16 precision (fp32 is exact above)
    assert report["mixed_dtype_fsdp"] <= 2e-2


@pytest.mark.distributed
def test_fl2va_and_ref2va_conditioning_rows_split_like_the_rest(report):
    assert set(report["workflows"]) == {
        f"WORKFLOW_{w} {split}" for w in ("FL2VA", "REF2VA") for split in ("ulysses 2", "ring 2")
    }
    for name, diff in report["workflows"].items():
        assert diff <= TOLERANCE, f"{name}: max abs difference {diff}"


@pytest.mark.distributed
def test_the_local_kernel_slot_splits_the_sequence_with_ulysses(report):
    # FlashAttention 4 and cuDNN FP8 sit in this slot on GPUs; here a CPU kernel does, through the same path
    assert set(report["local_kernel_slot"]) == {"ulysses 2 fsdp=False", "ulysses 2 fsdp=True"}
    for name, diff in report["local_kernel_slot"].items():
        assert diff <= TOLERANCE, f"{name}: max abs difference {diff}"


@pytest.mark.distributed
def test_compiled_blocks_split_the_sequence_like_eager_ones(report):
    # compile traces around diffusers' any-length all-to-alls (h3serve/services/dit/parallel.py), which it cannot trace
    assert report["compiled_ulysses"] <= TOLERANCE


@pytest.mark.distributed
def test_a_compiled_sequence_split_serves_prompts_of_any_length_and_stops_compiling(report):
    # Prompt lengths of every residue of the packed length modulo 4 (the lengths the warm-up runs before SERVING,
    # warmup.prompt_lengths): the blocks' own forwards are compiled, diffusers' split hooks run outside them, so
    # the two parities compile and nothing after (with the hooks compiled too, every residue compiled again and the
    # second length passed torch's recompile limit of 8).
    graphs = report["compiled_graphs"]
    assert len(graphs) == 7 and graphs[0] > 0 and graphs[2:] == [0] * 5, graphs


@pytest.mark.distributed
def test_adapters_switched_per_request_on_fsdp2_shards_give_the_one_rank_latents(report):
    adapters = report["adapters"]
    assert adapters.pop("resident sharded") and adapters.pop("slots sharded"), "FSDP2 shards the LoRA factors too"
    assert len(adapters) == 8, "two ways to switch, four requests each: a, b, a at 0.5, none"
    for name, diff in adapters.items():
        assert diff <= TOLERANCE, f"{name}: max abs difference {diff}"
