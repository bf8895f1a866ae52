"""SageAttention from the package index (`sageattention` 1.0.6: Triton kernels, INT8 Q.K, FP16 P.V).

The attention that made the seeds' 4 x RTX 2080 Ti box work: on sm_75 no fused bf16 SDPA kernel exists,
so bf16 attention falls to MATH, which materialises the S x S scores. Sage quantises Q and K per block to
int8 and runs P.V in fp16, returning the input dtype: the DiT stays bf16 everywhere else. It runs through
the local slot (h3serve/runtime/kernels/local.py), so it is Ulysses-capable like `flash4`.

K is smoothed here, out of place: the package's own `smooth_k` subtracts the mean from the caller's keys in
place, which an opaque custom op must not do. Subtracting K's mean over the tokens moves every score of one
query row by the same amount, so the softmax is unchanged and the int8 range is spent on what differs.
diffusers' own `sage*` backends need a SageAttention >= 2.1.1 build (from source; docs/deploy/small-gpus.md).

Which build runs where: 1.x is Triton only, and Triton (3.3 on) targets sm_80 and newer; below that its matrix
products run without tensor cores. On sm_75 the package's `sageattn` must come from a SageAttention 2.x build for
that card (`TORCH_CUDA_ARCH_LIST=7.5`), whose `sageattn` dispatches to CUDA kernels; `check_build` refuses 1.x there.
"""

from __future__ import annotations

import torch

from h3serve.runtime.kernels import slot

NAME = "sage"
TRITON_CAPABILITY = (8, 0)  # the oldest GPU Triton targets


def installed_version() -> str:
    from importlib.metadata import version

    return version("sageattention")


def check_build(capability: tuple[int, int]) -> None:
    """RuntimeError when the installed sageattention has no kernel for this GPU worth running."""
    installed = installed_version()
    if int(installed.split(".")[0]) < 2 and capability < TRITON_CAPABILITY:
        raise RuntimeError(
            f"attention backend {NAME!r}: sageattention {installed} is Triton only, and Triton targets "
            f"sm_80 and newer; on sm_{capability[0]}{capability[1]} install a SageAttention 2.x build "
            f"for it (TORCH_CUDA_ARCH_LIST={capability[0]}.{capability[1]}, docs/deploy/small-gpus.md)"
        )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None, causal: bool = False
) -> torch.Tensor:
    """(batch, rows, heads, head_dim) attention without a mask; returns q's dtype."""
    return torch.ops.h3serve.sage(q, k, v, slot.softmax_scale(q, softmax_scale, causal))


@torch.library.custom_op("h3serve::sage", mutates_args=())
def sage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    from sageattention import sageattn

    smoothed = (k - k.mean(dim=1, keepdim=True)).contiguous()
    return sageattn(
        q.contiguous(), smoothed, v.contiguous(), tensor_layout="NHD", is_causal=False, sm_scale=scale, smooth_k=False
    )


@sage.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)
