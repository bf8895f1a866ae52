"""What diffusers' context parallelism lacks on CPU ranks joined by gloo (the test and dev set-up).

Three gaps, each verified (docs/deploy/sharded-dit.md, "CPU ranks over gloo"), each closed here and only on CPU:
- diffusers picks the rank's device as `rank % torch.accelerator.device_count()`, which is 0 on CPU;
- ring attention needs the log-sum-exp of each partial attention, and no CPU backend returns it:
  the CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`) does;
- the `*_anything` modes all-gather shards of unequal size at the end, which gloo refuses:
  gathering equal padded shards and trimming gives the same tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_applied = False


def apply() -> None:
    """Idempotent; call before `enable_parallelism` on a CPU rank."""
    global _applied
    if _applied:
        return
    import diffusers.hooks.context_parallel as cp_hooks
    import diffusers.models.attention_dispatch as dispatch

    torch.accelerator.device_count = lambda: 1
    native_op = dispatch._native_attention_forward_op

    def native_forward_op(ctx, query, key, value, *args, **kwargs):
        if not _wants_lse(args, kwargs) or query.device.type != "cpu":
            return native_op(ctx, query, key, value, *args, **kwargs)
        scale = kwargs.get("scale", args[3] if len(args) > 3 else None)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(x.transpose(1, 2) for x in (query, key, value)), scale=scale
        )[:2]
        return out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()

    dispatch._native_attention_forward_op = native_forward_op
    cp_hooks._all_gather_anything = _padded_all_gather
    _applied = True


def _wants_lse(args: tuple, kwargs: dict) -> bool:
    # positional order after (ctx, q, k, v): attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse
    return bool(kwargs.get("return_lse", args[5] if len(args) > 5 else False))


def _padded_all_gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather shards whose size along `dim` differs by rank: pad to the largest, gather, trim."""
    tensor = tensor.contiguous()
    gathered_sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered_sizes, torch.tensor([tensor.shape[dim]]), group=group)
    sizes = [int(s) for s in gathered_sizes]
    padded_shape = list(tensor.shape)
    padded_shape[dim] = max(sizes)
    padded = tensor.new_zeros(padded_shape)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(gathered, sizes, strict=True)], dim=dim)
