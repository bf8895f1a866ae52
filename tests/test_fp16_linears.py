"""fp16 linears that cannot overflow (h3serve/runtime/fp16_linears.py) and int8 weights (runtime/int8_weights.py).

The activations are driven to the maxima a public report measured on the released model (the residual stream at
4.3M, `attn.to_out.0` and `ff.net.2` outputs past 2M, `context_embedder`'s input ~96k): random weights never reach
them, so the weights of the tiny model and of one full-size block are scaled until they do (`drive`), and each
check asserts that they did. There plain fp16 overflows and fp16_scaled stays finite and close to fp32.
"""

from __future__ import annotations

import copy

import pytest
import torch

from bench.accuracy import capture_forward, forward_output, rel_l2
from bench.common import Size, denoise_spec
from h3serve.common.config import DiTConfig
from h3serve.runtime import fastpath, fp16_linears, int8_weights
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.tiny import build_component
from h3serve.services.dit.runner import DenoiseRunner, served

RESIDUAL_MAX = 4.3e6  # the report's residual stream after 50 blocks
BRANCH_MAX = 2e6  # the report's "past 2M" for attn.to_out.0 and ff.net.2
BRANCH_TARGET = 2.5e6  # where `drive` aims them (to_out.0's K = 64 overflows past 64 x 65504 = 4.2M)
CONTEXT_INPUT_MAX = 9.6e4  # the report's condition_proj (context_embedder) magnitude, above fp16's 65504
FP16_MAX = torch.finfo(torch.float16).max
# fp16_scaled rounds its GEMM operands to fp16 (11-bit significand) where bf16 rounds to 8 bits: it must be at least
# as close to fp32 as the bf16 path is (measured on the tiny model: bf16 5.3e-3, fp16_scaled 2.4e-3)
FP16_TOLERANCE = 1e-2
INT8_TOLERANCE = 2e-2  # int8 weights add a rounding of 1/254 of each row's range (measured 2.4e-3 on the tiny model)
BRANCHES = ("attn.to_out.0", "ff.net.2")
# the linear whose output feeds each branch: `drive` scales both (the branch's weight alone would leave fp16's range
# on the tiny model, whose few input channels make a small sum)
# and the root of the factor each takes: the attention is linear in V, SwiGLU's product quadratic in its projection
FEEDERS = {"attn.to_out.0": ("attn.to_v", 1 / 2), "ff.net.2": ("ff.net.0.proj", 1 / 3)}
DRIVE_PASSES = 4
RESIDUAL_ENTRY = 1.1 * RESIDUAL_MAX  # the video rows' entry into the stream: the branches add to it and subtract


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


# ---- activations driven to the reported maxima ----


class Maxima:
    """The largest |output| of each branch linear and block (the residual stream) during the forwards it watches."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.values: dict[str, float] = {}
        watched = [
            (name, module)
            for name, module in model.named_modules()
            if name.endswith(BRANCHES) or type(module).__name__ == "MiniMaxH3TransformerBlock"
        ]
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in watched]

    def _hook(self, name: str):
        def record(_module, _args, out) -> None:
            self.values[name] = max(self.values.get(name, 0.0), float(out.detach().float().abs().max()))

        return record

    def of(self, kind: str) -> float:
        """The largest over the modules of a kind: a branch (`BRANCHES`) or "block"."""
        blocks = [v for name, v in self.values.items() if not name.endswith(BRANCHES)]
        return max(blocks if kind == "block" else [v for name, v in self.values.items() if name.endswith(kind)])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def drive(model: torch.nn.Module, run, passes: int = DRIVE_PASSES) -> dict[str, float]:
    """Scale each of `model`'s block branches and their feeders (`FEEDERS`) by a root of what its output lacks of
    BRANCH_TARGET, pass after pass (a branch's input moves with the branches before it: the passes converge); the
    maxima seen at the end."""
    watch = Maxima(model)
    branches = [name for name, _ in model.named_modules() if name.endswith(BRANCHES) and name.startswith("transformer")]
    with torch.no_grad():
        for _ in range(passes):
            watch.values.clear()
            run()
            for name in branches:
                kind = next(kind for kind in BRANCHES if name.endswith(kind))
                feeder, root = FEEDERS[kind]
                factor = (BRANCH_TARGET / watch.values[name]) ** root
                feeder = name.removesuffix(kind) + feeder
                model.get_submodule(name).weight.mul_(factor)
                model.get_submodule(feeder).weight.mul_(factor)
        watch.values.clear()
        run()
    watch.remove()
    return {kind: watch.of(kind) for kind in (*BRANCHES, "block")}


@pytest.fixture(scope="module")
def driven_tiny(tiny) -> tuple[torch.nn.Module, tuple, dict]:
    """The tiny transformer (fp32) with its video rows entering the stream at RESIDUAL_ENTRY, its text input at
    CONTEXT_INPUT_MAX and its branches past BRANCH_MAX."""
    model = copy.deepcopy(tiny[0])
    args, kwargs = copy.deepcopy(tiny[1])
    text = kwargs["encoder_hidden_states"]
    kwargs["encoder_hidden_states"] = text * (CONTEXT_INPUT_MAX / text.abs().max())
    with torch.no_grad():
        start = model.proj_in(kwargs["hidden_states"]).abs().max()
        for param in model.proj_in.parameters():
            param.mul_(RESIDUAL_ENTRY / start)
    maxima = drive(model, lambda: forward_output(model, (args, kwargs)))
    return model, (args, kwargs), maxima


def test_the_tiny_model_driven_to_the_reported_maxima_overflows_fp16_but_not_fp16_scaled(driven_tiny):
    model, inputs, maxima = driven_tiny
    assert maxima["block"] >= RESIDUAL_MAX and min(maxima[kind] for kind in BRANCHES) >= BRANCH_MAX, maxima
    reference = forward_output(model, inputs)
    assert reference.isfinite().all()
    assert not forward_output(copy.deepcopy(model).half(), inputs).isfinite().all(), "plain fp16 overflows"
    for weights, tolerance in (("bf16", FP16_TOLERANCE), ("int8", INT8_TOLERANCE)):
        out = forward_output(scaled(bf16(model), weights), inputs)
        assert out.isfinite().all(), weights
        assert rel_l2(out, reference) <= tolerance, (weights, rel_l2(out, reference))
