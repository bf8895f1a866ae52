"""FP8 attention on Hopper: cuDNN's fused FP8 SDPA, with the scaling done around it in PyTorch.

cuDNN's FP8 kernel (reached through `nvidia-cudnn-frontend`) takes one scale per tensor. Finer
scaling is folded in outside it, where torch.compile fuses it into the surrounding elementwise work:
- K is smoothed: its mean over the tokens is subtracted per head and channel. Every score of one
  query row moves by the same amount, so the softmax, and the output, are unchanged, while the
  range the E4M3 values must cover shrinks (what SageAttention does).
- V is scaled per head and channel to the full E4M3 range before quantisation, and the output
  (a convex combination of V's rows, so within the same range) is unscaled per channel after.
- P, the softmax probabilities in [0, 1], is scaled by 448 inside the kernel.
On Hopper the kernel's output is E4M3 as well (a bf16 output is Blackwell-only).
Opt-in: this changes the numbers. `bench/dit_step.py --errors` measures by how much.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from h3serve.runtime.kernels import slot

E4M3_MAX = 448.0
NAME = "cudnn_fp8"


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None, causal: bool = False
) -> torch.Tensor:
    """(batch, rows, heads, head_dim) attention without a mask, computed in FP8; returns q's dtype."""
    scale = slot.softmax_scale(q, softmax_scale, causal)
    k = k.float()
    k = k - k.mean(dim=1, keepdim=True)
    q8, descale_q = _per_tensor(q.float())
    k8, descale_k = _per_tensor(k)
    v_scale = v.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    v8 = (v.float() / v_scale).to(torch.float8_e4m3fn)
    out = torch.ops.h3serve.cudnn_fp8_sdpa(q8, k8, v8, descale_q, descale_k, scale)
    return (out.float() * v_scale).to(q.dtype)


def _per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values of `x` scaled to the full range, and the (1, 1, 1, 1) fp32 factor that undoes it."""
    descale = (x.abs().amax().clamp(min=1e-12) / E4M3_MAX).reshape(1, 1, 1, 1)
    return (x / descale).to(torch.float8_e4m3fn), descale


@torch.library.custom_op("h3serve::cudnn_fp8_sdpa", mutates_args=())
def cudnn_fp8_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: torch.Tensor, descale_k: torch.Tensor, scale: float
) -> torch.Tensor:
    """E4M3 (batch, rows, heads, head_dim) q, k, v -> E4M3 output, through one cuDNN FP8 SDPA graph."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    _Graph.for_shape(tuple(q.shape), q.device.index, scale).run(q, k, v, out, descale_q, descale_k)
    return out


@cudnn_fp8_sdpa.register_fake
def _(q, k, v, descale_q, descale_k, scale):
    return torch.empty_like(q)


@dataclass
class _Graph:
    """A built cuDNN FP8 SDPA graph for one (batch, rows, heads, head_dim) shape on one device."""

    graph: Any  # cudnn.pygraph: cudnn has no types
    tensors: dict
    constants: dict
    workspace: torch.Tensor
    handle: Any

    @staticmethod
    @functools.cache
    def for_shape(shape: tuple[int, int, int, int], device: int, scale: float) -> _Graph:
        import cudnn

        handle = cudnn.create_handle()
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
        batch, rows, heads, head_dim = shape
        dims = (batch, heads, rows, head_dim)  # cuDNN's order, over the (batch, rows, heads, dim) layout
        strides = (rows * heads * head_dim, head_dim, heads * head_dim, 1)
        q, k, v = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in ("q", "k", "v"))
        scalar = {"dim": (1, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": fp32}
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        scalars = {n: graph.tensor(name=n, **scalar) for n in names}
        out, _, amax_s, amax_o = graph.sdpa_fp8(
            q=q, k=k, v=v, **scalars, is_inference=True, attn_scale=scale, use_causal_mask=False
        )
        out.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        on = torch.device("cuda", device)
        # V arrives scaled per channel and P is scaled to [0, 448]: the kernel's own factors are fixed.
        factors = {
            scalars["descale_v"]: 1.0,
            scalars["descale_s"]: 1.0 / E4M3_MAX,
            scalars["scale_s"]: E4M3_MAX,
            scalars["scale_o"]: 1.0,
        }
        constants = {t: torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=on) for t, value in factors.items()}
        constants.update({amax: torch.empty((1, 1, 1, 1), dtype=torch.float32, device=on) for amax in (amax_s, amax_o)})
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=on)
        tensors = {
            "q": q,
            "k": k,
            "v": v,
            "out": out,
            "descale_q": scalars["descale_q"],
            "descale_k": scalars["descale_k"],
        }
        return _Graph(graph, tensors, constants, workspace, handle)

    def run(self, q, k, v, out, descale_q, descale_k) -> None:
        import cudnn

        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
        named = {"q": q, "k": k, "v": v, "out": out, "descale_q": descale_q, "descale_k": descale_k}
        pack = {self.tensors[n]: t for n, t in named.items()} | self.constants
        self.graph.execute(pack, self.workspace, handle=self.handle)
