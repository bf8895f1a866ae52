"""fp16 linears that cannot overflow (`[dit] linear_precision = "fp16_scaled"`), for cards without bf16 tensor cores.

sm_75 (Turing) has fp16 tensor cores and none for bf16, so the DiT's bf16 GEMMs there run without them
(docs/turing-memory.md says which cuBLAS path). Plain fp16 overflows MiniMax-H3 (black frames): a public report
(`minimax-h3-fp16-fix`, /work/shared/docs/turing-notes.md) measured `condition_proj` (our `context_embedder`) at
~96k, the residual stream at 81k growing to 4.3M over the 50 blocks, and `attn.out_proj` / the MLP's `fc2` (our
`attn.to_out.0` / `ff.net.2`) past 2M, all beyond fp16's 65504. `convert` applies its cure:

- the residual stream and every non-linear part (norms, gates, modulation, SwiGLU) in fp32;
- every bf16 linear becomes a `ScaledFp16Linear`: y = fp16_gemm(x / K, W) * K + b, the GEMM on fp16 tensor cores
  with fp32 accumulation, K a power of two so the scaling is exact, K per layer kind in `SCALES` (data: random
  weights do not reproduce a trained model's ranges, so these are the reported ones);
- `context_embedder`, whose input passes 65504, stays a plain fp32 linear (its text rows are few);
- the attention's own path (to_q/to_k/to_v outputs, qk-norm, rope, the kernel) keeps the model dtype (bf16): the
  attention kernel takes bf16 and carries V beyond fp16's range itself.

The same module holds int8 weights (`weights = "int8"`, h3serve/runtime/int8_weights.py): each is widened to fp16
with its per-output-channel scale as it runs, then takes the same GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from h3serve.runtime import int8_weights
from h3serve.runtime.sharded_load import LocalRows, Weights

LINEAR_PRECISIONS = ("bf16", "fp16_scaled")  # [dit] linear_precision
WEIGHT_FORMATS = ("bf16", "int8")  # [dit] weights: "int8" needs linear_precision = "fp16_scaled"
STREAM_DTYPE = torch.float32  # the residual stream and the non-linear parts
GEMM_DTYPE = torch.float16
FP32 = None  # a `Scale.k` meaning: no fp16 GEMM, the layer runs in fp32


@dataclass(frozen=True)
class Scale:
    """How one layer kind runs: `k`, the power of two its input is divided by before the fp16 GEMM and its output
    multiplied by after (FP32: a plain fp32 linear); `to_attention`, whether its output feeds the attention kernel
    (kept in the model dtype) rather than the fp32 stream."""

    k: int | None = 1
    to_attention: bool = False


# Per layer kind, by the end of the module's name (diffusers' MiniMax-H3 names; the token refiner's blocks share
# them). The first match wins; a bf16 linear matching none gets DEFAULT. Sources: the minimax-h3-fp16-fix report.
SCALES: tuple[tuple[str, Scale], ...] = (
    ("context_embedder", Scale(FP32)),  # its input (Qwen3-VL hidden states) reaches ~96k
    ("attn.to_out.0", Scale(64)),  # out_proj: past 2M
    ("ff.net.2", Scale(256)),  # fc2: past 2M
    ("attn.to_q", Scale(1, to_attention=True)),
    ("attn.to_k", Scale(1, to_attention=True)),
    ("attn.to_v", Scale(1, to_attention=True)),
)
DEFAULT = Scale(1)  # ff.net.0.proj, adaln_proj.linear, norm_out.linear


def scale_of(name: str) -> Scale:
    return next((scale for suffix, scale in SCALES if name == suffix or name.endswith("." + suffix)), DEFAULT)


class ScaledFp16Linear(nn.Module):
    """y = fp16_gemm(x / k, W) * k + b, returned in `out_dtype`. `weight` is fp16, or int8 with `weight_scale`
    (fp32, one per output channel: W = weight * weight_scale); the bias is fp32, added after the GEMM. Its
    parameters never train (FSDP2 then takes the mixed dtypes of one group)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        k: int,
        out_dtype: torch.dtype,
        weight_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if k < 1 or k & (k - 1):
            raise ValueError(f"k = {k} must be a power of two (the scaling is exact only then)")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = None if weight_scale is None else nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.k, self.out_dtype = k, out_dtype
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight_scale is None else widen(self.weight, self.weight_scale)
        inputs = x.to(GEMM_DTYPE) if self.k == 1 else (x.float() * (1.0 / self.k)).to(GEMM_DTYPE)
        out = nn.functional.linear(inputs, weight)
        if self.k != 1 or self.bias is not None:
            out = out.float() * self.k if self.k != 1 else out.float()
        if self.bias is not None:
            out = out + self.bias
        return out.to(self.out_dtype)

    def extra_repr(self) -> str:
        held = "int8 + fp32 scale" if self.weight_scale is not None else str(self.weight.dtype)
        return f"{self.in_features} -> {self.out_features}, k={self.k}, weight {held}, out {self.out_dtype}"


def widen(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 weight as fp16: one fp16 copy of it (the GEMM's workspace), scaled per output channel in fp16."""
    return weight.to(GEMM_DTYPE).mul_(scale.to(GEMM_DTYPE)[:, None])


@dataclass(frozen=True)
class SourceParam:
    """What a converted parameter is read from: the source's parameter of that name, its dtype and whole shape."""

    name: str
    dtype: torch.dtype
    shape: torch.Size


def convert(model: nn.Module, dtype: torch.dtype, int8: bool = False) -> dict[str, SourceParam]:
    """Make `model` (a MiniMax-H3 transformer, materialised or on the meta device) run `fp16_scaled`: its `dtype`
    linears become `ScaledFp16Linear`s per `SCALES`, its other `dtype` parameters fp32 except the attention's
    qk-norms. With `int8` a block linear's weight is held as int8 with its scales (h3serve/runtime/int8_weights.py)
    instead of fp16. Returns the parameters whose dtype changed, with the dtype they had (`ConvertedRows`)."""
    changed = {
        name: SourceParam(name, dtype, param.shape)
        for name, param in model.named_parameters()
        if param.dtype == dtype and not _attention_norm(name)
    }
    # by name, one module at a time: a list of the modules would keep every replaced weight alive until the end
    # (the released transformer's bf16 weights twice over)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.dtype == dtype]
    for name in linears:
        owner, _, attribute = name.rpartition(".")
        module = cast(nn.Linear, model.get_submodule(name))
        setattr(model.get_submodule(owner), attribute, _converted(name, module, dtype, int8))
        if _held_int8(name, int8):
            weight = f"{name}.weight"
            changed[weight + int8_weights.SCALE_SUFFIX] = SourceParam(weight, dtype, module.weight.shape)
        del module
    for name, param in model.named_parameters():
        if name in changed and param.dtype == dtype:
            param.data = param.data.to(STREAM_DTYPE)
    return changed


def _converted(name: str, linear: nn.Linear, dtype: torch.dtype, int8: bool) -> nn.Module:
    scale = scale_of(name)
    bias = None if linear.bias is None else linear.bias.data.to(STREAM_DTYPE)
    if scale.k is FP32:
        return linear.to(STREAM_DTYPE).requires_grad_(False)
    out_dtype = dtype if scale.to_attention else STREAM_DTYPE
    if _held_int8(name, int8):
        weight, weight_scale = int8_weights.quantize(linear.weight.data)
        return ScaledFp16Linear(weight, bias, scale.k, out_dtype, weight_scale)
    return ScaledFp16Linear(linear.weight.data.to(GEMM_DTYPE), bias, scale.k, out_dtype)


def _held_int8(name: str, int8: bool) -> bool:
    """int8 holds the block linears (33.1 B of the released 33.4 B parameters); the rest stays fp16."""
    return int8 and name.startswith(int8_weights.BLOCKS) and scale_of(name).k is not FP32


def _attention_norm(name: str) -> bool:
    """The qk-norms act on the attention's inputs, which stay in the model dtype."""
    return ".norm_q." in name or ".norm_k." in name


def describe(precision: str, weights: str) -> str:
    """What the start log says runs."""
    if precision == "bf16":
        return "linears bf16"
    held = "int8 weights widened to fp16 per linear" if weights == "int8" else "fp16 weights"
    kinds = ", ".join(f"{suffix} {'fp32' if s.k is FP32 else f'k={s.k}'}" for suffix, s in SCALES if s.k != 1)
    return f"linears fp16_scaled ({held}; fp32 residual stream; {kinds}; others k=1)"


@dataclass(frozen=True)
class ConvertedRows:
    """`source`'s values for a skeleton `convert` changed (`changed`: its return), rank by rank: a changed
    parameter's rows are read in the source's dtype (so random weights draw what a bf16 load draws) and then
    converted; an int8 weight's rows and their scales are quantised from the same rows of the source's weight (the
    scale is per row, so no rank reads more than its own rows). Every other parameter is read as it is."""

    source: Weights
    changed: dict[str, SourceParam]

    @property
    def label(self) -> str:
        return self.source.label

    def factory(self) -> nn.Module:
        return self.source.factory()

    def fill(self, name: str, rows: LocalRows) -> None:
        if name not in self.changed:
            self.source.fill(name, rows)
        elif name.endswith(int8_weights.SCALE_SUFFIX):
            rows.tensor.copy_(int8_weights.quantize(self._read(self.changed[name], rows))[1])
        elif rows.tensor.dtype == torch.int8:
            rows.tensor.copy_(int8_weights.quantize(self._read(self.changed[name], rows))[0])
        else:
            rows.tensor.copy_(self._read(self.changed[name], rows))

    def _read(self, param: SourceParam, rows: LocalRows) -> torch.Tensor:
        """The source's rows of `param` that `rows` holds (the same first row and count), in the source's dtype."""
        shape = (rows.tensor.shape[0], *param.shape[1:])
        values = torch.empty(shape, dtype=param.dtype, device=rows.tensor.device)
        self.source.fill(param.name, LocalRows(values, rows.start, param.shape))
        return values
