"""fp16 linears that cannot overflow (h3serve/runtime/fp16_linears.py) and int8 weights (runtime/int8_weights.py).

The activations are driven to the maxima a public report measured on the released model (the residual stream at
4.3M, `attn.to_out.0` and `ff.net.2` outputs past 2M, `context_embedder`'s input ~96k): random weights never reach
them, so the weights of the tiny model and of one full-size block are scaled until they do (`drive`), and each
check asserts that they did. There plain fp16 overflows and fp16_scaled stays finite and close to fp32.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from bench import overflow
from bench.accuracy import capture_forward, forward_output, rel_l2
from bench.common import Size, denoise_spec
from h3serve.common.config import DiTConfig
from h3serve.runtime import fastpath, fp16_linears, int8_weights
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.tiny import build_component
from h3serve.services.dit.runner import DenoiseRunner, served

# fp16_scaled rounds its GEMM operands to fp16 (11-bit significand) where bf16 rounds to 8 bits: it must be at least
# as close to fp32 as the bf16 path is (measured on the tiny model: bf16 5.3e-3, fp16_scaled 2.4e-3)
FP16_TOLERANCE = 1e-2
INT8_TOLERANCE = 2e-2  # int8 weights add a rounding of 1/254 of each row's range (measured 2.4e-3 on the tiny model)


def bf16(transformer: torch.nn.Module) -> torch.nn.Module:
    """The transformer as a bf16 checkpoint loads: its fp32-pinned modules stay fp32."""
    model = copy.deepcopy(transformer).to(torch.bfloat16)
    for name in model._keep_in_fp32_modules:
        getattr(model, name).float()
    return model


def scaled(model: torch.nn.Module, weights: str = "bf16") -> torch.nn.Module:
    converted = copy.deepcopy(model)
    fastpath.convert_linears(converted, FastPath(linears="fp16_scaled", weights=weights))
    return converted


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, tuple]:
    """The tiny transformer (fp32) and the inputs of one real forward of a t2va request."""
    transformer = build_component("transformer")
    parts = {"transformer": transformer, **{name: build_component(name) for name in ("scheduler", "audio_scheduler")}}
    runner = DenoiseRunner(parts, served(["t2va"]))
    embeds = torch.randn(1, 12, transformer.config.text_dim, generator=torch.Generator().manual_seed(0))
    spec = denoise_spec(Size.parse("32x64x124"), forwards=1)
    run = lambda: runner.run(spec, embeds, torch.ones(12, dtype=torch.int64), lambda step, total: None)  # noqa: E731
    return transformer, capture_forward(transformer, run)


def test_the_tiny_models_fp16_scaled_output_is_as_close_to_fp32_as_bf16s(tiny):
    transformer, inputs = tiny
    reference, model = forward_output(transformer, inputs), bf16(transformer)
    bf16_error = rel_l2(forward_output(model, inputs), reference)
    fp16_error = rel_l2(forward_output(scaled(model), inputs), reference)
    int8_error = rel_l2(forward_output(scaled(model, "int8"), inputs), reference)
    assert fp16_error <= min(bf16_error, FP16_TOLERANCE), (fp16_error, bf16_error)
    assert int8_error <= INT8_TOLERANCE, int8_error


def test_every_bf16_linear_is_converted_by_its_kind_and_the_stream_is_fp32(tiny):
    model = scaled(bf16(tiny[0]), "int8")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, fp16_linears.ScaledFp16Linear)}
    plain = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.dtype == torch.float32 for m in plain), "only the fp32 ones stay plain linears"
    assert model.context_embedder.weight.dtype == torch.float32, "its input passes fp16's range: fp32"
    block = "transformer_blocks.0."
    assert linears[block + "attn.to_out.0"].k == 64 and linears[block + "ff.net.2"].k == 256
    assert linears[block + "attn.to_q"].out_dtype == torch.bfloat16, "the attention takes the model dtype"
    assert linears[block + "ff.net.0.proj"].out_dtype == torch.float32
    assert linears[block + "ff.net.2"].weight.dtype == torch.int8, "int8 holds the block linears"
    assert linears["token_refiner.refiner_blocks.0.attn.to_out.0"].weight.dtype == torch.float16, "the rest: fp16"
    assert model.transformer_blocks[0].norm1.weight.dtype == torch.float32
    assert model.transformer_blocks[0].attn.norm_q.weight.dtype == torch.bfloat16
    assert fp16_linears.convert(model, torch.bfloat16) == {}, "converting again changes nothing"


def test_a_scale_must_be_a_power_of_two_so_the_scaling_is_exact():
    with pytest.raises(ValueError, match="power of two"):
        fp16_linears.ScaledFp16Linear(torch.zeros(2, 2, dtype=torch.float16), None, 48, torch.float32)


def test_int8_rows_round_trip_within_half_a_step_of_their_row():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 64)[:, None]
    weight[5] = 0.0
    q, scale = int8_weights.quantize(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == int8_weights.LEVELS
    assert torch.all((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-12)
    assert not q[5].any(), "a row of zeros stays zeros (no 0/0)"


def test_config_selects_the_linears_and_refuses_what_cannot_run_with_them():
    fast = FastPath.of(DiTConfig(dtype="bfloat16", linear_precision="fp16_scaled", weights="int8"))
    assert (fast.linears, fast.weights, fast.lossy) == ("fp16_scaled", "int8", True)
    assert fast.describe() == "native+fp16_scaled+int8"
    with pytest.raises(ValueError, match="needs linear_precision"):
        DiTConfig(dtype="bfloat16", weights="int8")
    for refused in ({"fp8": True}, {"dtype": "float32"}):
        with pytest.raises(ValueError, match="fp8 = false"):
            DiTConfig(**{"dtype": "bfloat16", **refused, "linear_precision": "fp16_scaled"})


# ---- activations driven to the reported maxima (bench/overflow.py) ----


@pytest.fixture(scope="module")
def driven_tiny(tiny) -> tuple[torch.nn.Module, tuple, dict]:
    """The tiny transformer (fp32) driven to the reported maxima, its inputs, and the maxima it reached."""
    model = copy.deepcopy(tiny[0])
    args, kwargs = copy.deepcopy(tiny[1])
    kwargs = overflow.drive_inputs(model, kwargs)
    maxima = overflow.drive(model, lambda: forward_output(model, (args, kwargs)))
    return model, (args, kwargs), maxima


def test_the_tiny_model_driven_to_the_reported_maxima_overflows_fp16_but_not_fp16_scaled(driven_tiny):
    model, inputs, maxima = driven_tiny
    assert overflow.reached(maxima), maxima
    reference = forward_output(model, inputs)
    assert reference.isfinite().all()
    assert not forward_output(copy.deepcopy(model).half(), inputs).isfinite().all(), "plain fp16 overflows"
    for weights, tolerance in (("bf16", FP16_TOLERANCE), ("int8", INT8_TOLERANCE)):
        out = forward_output(scaled(bf16(model), weights), inputs)
        assert out.isfinite().all(), weights
        assert rel_l2(out, reference) <= tolerance, (weights, rel_l2(out, reference))


# ---- one block of the released sizes ----

FULL_BLOCK = dict(
    hidden_size=5376,
    num_attention_heads=56,
    attention_head_dim=128,
    ffn_dim=14336,
    time_embed_dim=2688,
    norm_eps=1e-5,
    qk_norm_eps=1e-5,
)  # MiniMaxH3Transformer3DModel's defaults, the released ones: ~0.65 B parameters
ROWS = 8  # rows of the packed sequence: the overflow is per row, the cost is per row
TILE = 256  # rows of random values repeated down each weight (divides every full-size output width)


class OneBlock(torch.nn.Module):
    """One transformer block under the name the model gives it, so that convert and drive see it as they see the
    model's blocks."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList([block])

    def forward(self, hidden: torch.Tensor, *rest) -> torch.Tensor:
        return self.transformer_blocks[0](hidden, *rest)


def full_size_block() -> OneBlock:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    with torch.device("meta"):
        return OneBlock(MiniMaxH3TransformerBlock(**FULL_BLOCK))


def copy_as(block: OneBlock, dtype: torch.dtype) -> OneBlock:
    """`block` in `dtype`, never holding a second copy in its own dtype (a full-size block is 2.6 GB in fp32)."""
    twin = full_size_block()
    twin.load_state_dict({name: value.to(dtype) for name, value in block.state_dict().items()}, assign=True)
    return twin


@pytest.fixture(scope="module")
def full_block() -> tuple[OneBlock, torch.Tensor, tuple, dict]:
    """One full-size block in fp32 (bf16-representable values: the bf16 weights a load gives, widened) driven to the
    reported branch maxima, its residual input at RESIDUAL_ENTRY, the block's other inputs, and the maxima."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    block = full_size_block()
    generator = torch.Generator().manual_seed(5)
    block.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in block.named_parameters():
            if param.ndim == 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            bound = param.shape[1] ** -0.5  # PyTorch's default init range, as random:full draws
            tile = torch.empty(TILE, param.shape[1]).uniform_(-bound, bound, generator=generator)
            param.copy_(tile.to(torch.bfloat16).repeat(param.shape[0] // TILE, 1))
    rope = MiniMaxH3RotaryPosEmbed(rope_freq_dim=16, rope_theta=10000.0)
    rest = (
        torch.randn(1, FULL_BLOCK["time_embed_dim"], generator=generator),  # temb: one noise level
        torch.zeros(ROWS, dtype=torch.int64),  # adaln_indices: video rows of it
        rope(torch.stack([torch.arange(ROWS)] * 3, dim=1)),
    )
    hidden = torch.randn(1, ROWS, FULL_BLOCK["hidden_size"], generator=generator)
    hidden *= overflow.RESIDUAL_ENTRY / hidden.abs().max()
    maxima = overflow.drive(block, lambda: block(hidden, *rest))
    return block, hidden, rest, maxima


def test_a_full_size_block_driven_to_the_reported_maxima_overflows_fp16_but_not_fp16_scaled(full_block):
    block, hidden, rest, maxima = full_block
    assert overflow.reached(maxima), maxima
    with torch.no_grad():
        reference = block(hidden, *rest)
        plain = copy_as(block, torch.float16)
        within = hidden * (3e4 / hidden.abs().max())  # a residual fp16 can hold: the norm gives the branches the same
        assert not plain(within.half(), *rest).isfinite().all(), "plain fp16: the branches overflow"
        del plain
        for weights, tolerance in (("bf16", FP16_TOLERANCE), ("int8", INT8_TOLERANCE)):
            converted = copy_as(block, torch.bfloat16)
            fastpath.convert_linears(converted, FastPath(linears="fp16_scaled", weights=weights))
            out = converted(hidden, *rest)
            assert out.dtype == torch.float32 and out.isfinite().all(), weights
            assert rel_l2(out, reference) <= tolerance, (weights, rel_l2(out, reference))


def test_the_gpu_bench_runs_its_steps_on_the_tiny_model(tmp_path, monkeypatch):
    from bench import turing_linears

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = turing_linears.main(["--quick"])
    assert [r.name for r in rows] == ["turing_linears_32x64x124"] * 2 + ["turing_linears_driven_32x64x124"]
    assert all(r.rel_err_bf16 is not None and r.rel_err_bf16 <= INT8_TOLERANCE for r in rows)
    driven = json.loads((tmp_path / "turing_linears.json").read_text())["driven"]
    assert driven["reached"] and driven["scaled_finite"]
    assert not driven["plain_fp16_block_finite"] and not driven["plain_fp16_branch_finite"]
