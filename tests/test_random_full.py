"""random:full's weights (h3serve/runtime/random_full.py), on the tiny preset's modules: the released sizes do not
fit a CI machine, and the rule is the same at any size."""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel

from h3serve.model import presets
from h3serve.runtime import random_full
from h3serve.runtime.sharded_load import LocalRows, RandomWeights

TINY = functools.partial(MiniMaxH3Transformer3DModel, **presets.TINY_TRANSFORMER)


def built(factory=TINY, component: str = "transformer", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return random_full.materialise(random_full.skeleton(factory, dtype), component, "cpu")


def test_every_parameter_is_seeded_by_its_component_and_name():
    first, again, other = built(), built(), built(component="transformer_ref")
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other.parameters(), strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b), name
        if a.dim() > 1:
            assert not torch.equal(a, c), f"{name}: another component draws other values"


def test_values_stay_in_the_ranges_of_torchs_default_init_and_the_model_runs_finite():
    model = built()
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert not param.any(), name
        elif param.dim() == 1:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            bound = param.shape[1:].numel() ** -0.5
            assert param.abs().max() <= bound and param.std() > bound / 4, name  # uniform, not collapsed
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_whole_parameter_equals_the_first_rank_shard_of_the_sharded_loader():
    model = built()
    name, whole = next((n, p) for n, p in model.named_parameters() if p.dim() > 1)
    rows = torch.empty(whole.shape[0] // 2, *whole.shape[1:])
    RandomWeights("transformer").fill(name, LocalRows(rows, 0, whole.shape))
    assert torch.equal(rows, whole[:rows.shape[0]]), "one rule, seeded by the parameter and its first row"


def test_fp32_modules_stay_fp32_and_the_rest_takes_the_dtype():
    model = built(dtype=torch.bfloat16)
    kept = {n for n, _ in model.named_parameters() if random_full.keeps_fp32(model, n)}
    assert kept and len(kept) < len(list(model.parameters())), "proj_in, time_embedder, ...: fp32; the blocks: bf16"
    for name, tensor in model.named_parameters():
        assert tensor.dtype == (torch.float32 if name in kept else torch.bfloat16), name


@pytest.mark.parametrize("component", ["transformer", "vae"])
def test_a_meta_build_allocates_nothing(component):
    model = random_full.build_component(component, "meta", torch.bfloat16)
    assert {p.device.type for p in model.parameters()} == {"meta"}
