"""The sage_fp16 kernel's arithmetic (its CPU model, bench/sage_model.py) against fp64 attention: issue 49's bars.

On a GPU (`-m gpu`), the kernel itself against the model: the same numbers but for the kernel's ex2.approx and
its fp32 summation order.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import Size, denoise_spec
from bench.sage_model import attention_fp64, kernel_model, kernel_vs_model
from bench.sage_turing import inputs as bench_inputs
from h3serve.runtime.kernels import local, sage_prepare
from h3serve.runtime.kernels.sage_prepare import HEAD_DIM
from h3serve.runtime.tiny import build_component
from h3serve.services.dit.runner import DenoiseRunner, served

ROWS, HEADS = 1000, 2  # not a multiple of 64: the tail keys and rows are exercised
GAUSSIAN = {"cosine": 0.9999, "rel_l1": 0.015}
DIT_LIKE = {"cosine": 0.999, "rel_l1": 0.03}


def errors(q, k, v) -> dict[str, float]:
    scale = HEAD_DIM**-0.5
    got = kernel_model(sage_prepare.prepare(q, k, v, scale)).double()
    want = attention_fp64(q, k, v, scale)
    assert torch.isfinite(got).all()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    return {"cosine": cosine, "rel_l1": ((got - want).abs().sum() / want.abs().sum()).item()}


def meets(measured: dict[str, float], bar: dict[str, float]) -> bool:
    return measured["cosine"] >= bar["cosine"] and measured["rel_l1"] <= bar["rel_l1"]


def gaussian(seed: int, rows: int = ROWS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, rows, HEADS, HEAD_DIM, generator=generator).bfloat16() for _ in range(3)]


def test_gaussian_inputs_meet_the_bar():
    measured = errors(*gaussian(0))
    print("gaussian", measured)
    assert meets(measured, GAUSSIAN), measured


def test_a_per_channel_key_bias_is_smoothed_away():
    q, k, v = gaussian(1)
    bias = 8 * torch.randn(HEAD_DIM, generator=torch.Generator().manual_seed(2))
    measured = errors(q, (k.float() + bias).bfloat16(), v)
    print("key bias x8", measured)
    assert meets(measured, DIT_LIKE), measured


OUTLIER_CHANNELS = [3, 40, 77, 120]


def with_outliers(factor: float) -> list[torch.Tensor]:
    q, k, v = (t.float() for t in gaussian(3))
    q[..., OUTLIER_CHANNELS] *= factor
    k[..., OUTLIER_CHANNELS] *= factor
    return [t.bfloat16() for t in (q, k, v)]


@pytest.mark.parametrize("factor", [4, 8])
def test_outlier_channels_in_q_and_k_meet_the_dit_bar(factor):
    measured = errors(*with_outliers(factor))
    print(f"outliers x{factor}", measured)
    assert meets(measured, DIT_LIKE), measured


def test_outlier_channels_x20_fall_short_of_the_dit_cosine_bar():
    """Each row's int8 scale is its own largest value, which is an outlier channel's in every row: at x20 the
    cosine bar is missed (the measured figures are in docs/turing.md); the relative L1 bar still holds."""
    measured = errors(*with_outliers(20))
    print("outliers x20", measured)
    assert measured["cosine"] < DIT_LIKE["cosine"] and measured["rel_l1"] <= DIT_LIKE["rel_l1"], measured


def test_the_full_size_dit_like_case_meets_its_bar_at_2000_rows():
    """bench/sage_turing.py's DiT-like inputs (a per-channel K bias x8 and 4 outlier channels x4 in Q and K) on the
    CPU; one scale per 16 query rows and 64 keys missed the relative L1 bar here (0.031) and at full size on a
    lent H100, per-row scales alone measured 0.022 here and 0.0275 at 37,966 rows (bench/sage_rows.py): the op's
    shifted outlier channels hold a tighter bar."""
    measured = errors(*bench_inputs("dit-like", 2000, HEADS, device="cpu"))
    print("dit-like, 2000 rows", measured)
    assert meets(measured, {"cosine": DIT_LIKE["cosine"], "rel_l1": 0.02}), measured


def test_each_query_row_and_key_has_its_own_int8_scale():
    """An outlier in one row (and its mirror in another key, so that K's mean stays) sets those rows' scales only
    (a block's scale would be its largest row's); the outlier-channel shift is off to keep the order unchanged."""
    q, k, v = (t.float() for t in gaussian(6))
    before = sage_prepare.prepare(q, k, v, 1.0, max_shift=0)
    q[0, 5, 1, 9], k[0, 7, 0, 2], k[0, 8, 0, 2] = 1000.0, k[0, 7, 0, 2] + 1000, k[0, 8, 0, 2] - 1000
    after = sage_prepare.prepare(q, k, v, 1.0, max_shift=0)
    assert (after.q_scale != before.q_scale).nonzero().tolist() == [[1, 5]]
    assert (after.k_scale != before.k_scale).nonzero().tolist() == [[0, 7], [0, 8]]


@pytest.mark.parametrize("factor, shift", [(4, 1), (8, 2), (20, 3)])
def test_the_outlier_channels_come_first_with_their_shift(factor, shift):
    """4 channels x factor in Q and K: per head they are among the first 16 (the kernel's first step), divided by
    2**shift: the median row's ratio of their amax to the other channels' (half the factor: a row's 4 outliers
    reach less far than its 124 others), as log2 rounded."""
    q, k, _ = with_outliers(factor)
    order, q_shift, k_shift = sage_prepare.outlier_channels(q, k, sage_prepare.OUTLIER_SHIFT_MAX)
    assert all(set(OUTLIER_CHANNELS) <= set(head[:16].tolist()) for head in order)
    assert sorted(order[0].tolist()) == list(range(HEAD_DIM))
    assert q_shift.tolist() == k_shift.tolist() == [shift] * HEADS


def test_gaussian_inputs_have_no_outlier_shift():
    q, k, _ = gaussian(3)
    _, q_shift, k_shift = sage_prepare.outlier_channels(q, k, sage_prepare.OUTLIER_SHIFT_MAX)
    assert q_shift.tolist() == k_shift.tolist() == [0] * HEADS


def test_the_pre_pass_leaves_fp32_inputs_as_they_were():
    q, k, v = with_outliers(8)
    inputs = [t.float() for t in (q, k, v)]
    sage_prepare.prepare(*inputs, HEAD_DIM**-0.5)
    assert all(torch.equal(given, t.float()) for given, t in zip(inputs, (q, k, v), strict=True))


def test_the_model_on_the_first_query_rows_computes_what_it_does_for_all():
    """bench/sage_rows.py runs full-size rows on a sample of query rows: each row's arithmetic is its own."""
    p = sage_prepare.prepare(*gaussian(7), HEAD_DIM**-0.5)
    assert torch.equal(kernel_model(p, queries=300), kernel_model(p)[:, :300])


@pytest.mark.parametrize("magnitude", [4e3, 1e5])
def test_same_sign_large_values_stay_finite_and_accurate(magnitude):
    q, k, v = gaussian(4)
    v = (magnitude * (1 + 0.1 * v.float())).bfloat16()  # every value ~ magnitude, one sign: sums add up
    assert v.float().abs().max() > (6e4 if magnitude > 65504 else 0)
    measured = errors(q, k, v)
    print(f"same-sign |V| {magnitude:g}", measured)
    assert meets(measured, GAUSSIAN), measured


@pytest.fixture(scope="module")
def tiny_attention_inputs() -> list[tuple[torch.Tensor, ...]]:
    """The q, k, v of every attention call in one forward of the tiny MiniMax-H3 (through the local slot)."""
    from diffusers.models.attention_dispatch import (
        _HUB_KERNELS_REGISTRY,
        AttentionBackendName,
        _AttentionBackendRegistry,
    )

    calls = []

    def capture(q, k, v, softmax_scale=None, causal=False):
        calls.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        return attention_fp64(q, k, v, q.shape[-1] ** -0.5).to(q.dtype)

    slot = _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB]
    before, active = slot.kernel_fn, _AttentionBackendRegistry._active_backend  # process-wide: put back after
    transformer = build_component("transformer")
    local.install(capture)
    local.use(transformer)
    try:
        parts = {
            "transformer": transformer,
            "scheduler": build_component("scheduler"),
            "audio_scheduler": build_component("audio_scheduler"),
        }
        embeds = torch.randn(1, 12, transformer.config.text_dim, generator=torch.Generator().manual_seed(0))
        runner = DenoiseRunner(parts, served(["t2va"]), device=torch.device("cpu"))
        spec = denoise_spec(Size.parse("32x64x124"), forwards=1)
        runner.run(spec, embeds, torch.ones(12, dtype=torch.int64), lambda step, total: None)
    finally:
        slot.kernel_fn = before
        _AttentionBackendRegistry.set_active_backend(active)
    return calls


def test_the_tiny_models_real_attention_inputs_meet_the_dit_bar(tiny_attention_inputs):
    """The tiny model's head dim is 16: its channels are zero-padded to the kernel's 128 (zeros change no dot
    product and no output channel), with the tiny model's own softmax scale."""
    assert tiny_attention_inputs
    for q, k, v in tiny_attention_inputs:
        width = HEAD_DIM - q.shape[-1]
        scale = q.shape[-1] ** -0.5
        padded = [torch.nn.functional.pad(t.float(), (0, width)).bfloat16() for t in (q, k, v)]
        got = kernel_model(sage_prepare.prepare(*padded, scale)).double()[..., : q.shape[-1]]
        want = attention_fp64(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale)
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        rel_l1 = ((got - want).abs().sum() / want.abs().sum()).item()
        print(f"tiny attention {tuple(q.shape)}: cosine {cosine:.6f}, rel L1 {rel_l1:.4f}")
        assert torch.isfinite(got).all() and meets({"cosine": cosine, "rel_l1": rel_l1}, DIT_LIKE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "compute_75"])
@pytest.mark.parametrize("case", ["gaussian", "outliers x8 (shift 2 + 2)"])
def test_the_kernel_on_a_gpu_computes_what_its_model_does(target, case):
    from h3serve.runtime.kernels import sage

    major, minor = torch.cuda.get_device_capability()
    loaded = sage.kernel(torch.cuda.current_device(), f"sm_{major}{minor}" if target == "native" else target)
    measured = kernel_vs_model(loaded, *(gaussian(5) if case == "gaussian" else with_outliers(8)))
    print(target, case, measured)
    assert measured["written"] and measured["matches"], measured
