"""A CPU model of the sage_fp16 kernel's arithmetic against fp64 attention (issue 49's accuracy bars).

The model takes the kernel's own inputs (h3serve/runtime/kernels/sage_prepare.py runs here as on the GPU) and
repeats its loop: 64-key tiles, int8 Q.K^T exact in int32, scores = float(int32) * (q_scale * k_scale) in fp32,
online softmax in fp32 with exp2, P rounded to fp16, P.V accumulated in fp32, O / l * v_scale rounded to bf16.
Two points differ by less than the bars can see: the kernel's ex2.approx (2 ulp) and its fp32 summation order.
"""

from __future__ import annotations

import pytest
import torch

from bench.common import Size, denoise_spec
from h3serve.runtime.kernels import local, sage_prepare
from h3serve.runtime.kernels.sage_prepare import BLOCK_K, HEAD_DIM, WARP_ROWS, Prepared
from h3serve.runtime.tiny import build_component
from h3serve.services.dit.runner import DenoiseRunner, served

ROWS, HEADS = 2000, 2  # not a multiple of 64: the tail keys and rows are exercised
GAUSSIAN = {"cosine": 0.9999, "rel_l1": 0.015}
DIT_LIKE = {"cosine": 0.999, "rel_l1": 0.03}


def kernel_model(p: Prepared) -> torch.Tensor:
    """What the kernel writes, (batch, rows, heads, HEAD_DIM) bf16."""
    q8, k8, vt = p.q.double(), p.k.double(), p.vt.float()
    q_scale = p.q_scale.repeat_interleave(WARP_ROWS, dim=1)  # (batch*heads, n_pad): each warp's scale
    m = torch.full(q_scale.shape, float("-inf"))
    total = torch.zeros(q_scale.shape)  # the softmax denominator
    o = torch.zeros(*q_scale.shape, HEAD_DIM)
    keys = torch.arange(BLOCK_K)
    for tile in range(p.n_pad // BLOCK_K):
        window = slice(tile * BLOCK_K, (tile + 1) * BLOCK_K)
        acc = (q8 @ k8[:, window].transpose(1, 2)).float()  # exact: |acc| <= 127 * 127 * 128 < 2**24
        scores = acc * (q_scale * p.k_scale[:, tile : tile + 1])[..., None]
        scores = scores.masked_fill(tile * BLOCK_K + keys >= p.rows, float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1))
        alpha = torch.exp2(m - m_new)
        probs = torch.exp2(scores - m_new[..., None])
        total = total * alpha + probs.sum(dim=-1)
        o = o * alpha[..., None] + probs.half().float() @ vt[:, :, window].transpose(1, 2)
        m = m_new
    out = o * (1 / total)[..., None] * p.v_scale[:, None, :]
    out = out[:, : p.rows].view(p.batch, p.heads, p.rows, HEAD_DIM).transpose(1, 2)
    return out.to(torch.bfloat16)


def attention_fp64(q, k, v, scale):
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    return (torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v).transpose(1, 2)


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
    """Per-block int8 spends its range on the outlier channels, which sit in every block: at x20 the cosine bar
    is missed (the measured figures are in docs/turing.md); the relative L1 bar still holds."""
    measured = errors(*with_outliers(20))
    print("outliers x20", measured)
    assert measured["cosine"] < DIT_LIKE["cosine"] and measured["rel_l1"] <= DIT_LIKE["rel_l1"], measured


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
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    calls = []

    def capture(q, k, v, softmax_scale=None, causal=False):
        calls.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        return attention_fp64(q, k, v, q.shape[-1] ** -0.5).to(q.dtype)

    slot = _HUB_KERNELS_REGISTRY[AttentionBackendName.FLASH_4_HUB]
    before = slot.kernel_fn
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
