"""Drive a MiniMax-H3 transformer's activations to where the released model passes fp16's range.

A public report (`minimax-h3-fp16-fix`; h3serve/runtime/fp16_linears.py) measured the released model's residual
stream at 4.3M after 50 blocks, `attn.to_out.0` and `ff.net.2` outputs past 2M and `context_embedder`'s input at
~96k. Random weights never reach them, so `drive` scales a model's weights until a forward does, and `Maxima` says
what it reached. Shared by tests/test_fp16_linears.py (the tiny model) and bench/turing_linears.py (full size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RESIDUAL_MAX = 4.3e6  # the report's residual stream after 50 blocks
RESIDUAL_ENTRY = 1.1 * RESIDUAL_MAX  # where the video rows enter the stream: the branches add to it and subtract
BRANCH_MAX = 2e6  # the report's "past 2M" for attn.to_out.0 and ff.net.2
BRANCH_TARGET = 2.5e6  # where `drive` aims them (to_out.0's K = 64 overflows past 64 x 65504 = 4.2M)
CONTEXT_INPUT_MAX = 9.6e4  # the report's condition_proj (context_embedder) magnitude, above fp16's 65504
BRANCHES = ("attn.to_out.0", "ff.net.2")
# the linear whose output feeds each branch, and the root of the missing factor each of the two takes: the
# attention is linear in V, SwiGLU's product quadratic in its projection (the branch weight alone would leave fp16's
# range on the tiny model, whose few input channels make small sums)
FEEDERS = {"attn.to_out.0": ("attn.to_v", 1 / 2), "ff.net.2": ("ff.net.0.proj", 1 / 3)}
PASSES = 4  # a branch's input moves with the branches before it: each pass measures and rescales
BLOCK = "MiniMaxH3TransformerBlock"


class Maxima:
    """The largest |output| of each block branch linear and block (the residual stream) in the forwards it watches."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.values: dict[str, float] = {}
        watched = [(n, m) for n, m in model.named_modules() if is_branch(n) or type(m).__name__ == BLOCK]
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in watched]

    def _hook(self, name: str):
        def record(_module, _args, out) -> None:
            self.values[name] = max(self.values.get(name, 0.0), float(out.detach().abs().max()))

        return record

    def of(self, kind: str) -> float:
        """The largest over the modules of a kind: a branch (`BRANCHES`) or "block"."""
        if kind == "block":
            return max(v for name, v in self.values.items() if not is_branch(name))
        return max(v for name, v in self.values.items() if name.endswith(kind))

    def summary(self) -> dict[str, float]:
        return {kind: self.of(kind) for kind in (*BRANCHES, "block")}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def is_branch(name: str) -> bool:
    return name.startswith("transformer_blocks.") and name.endswith(BRANCHES)


@torch.no_grad()
def drive_inputs(model: torch.nn.Module, kwargs: dict) -> dict:
    """The forward's keyword inputs with the text at CONTEXT_INPUT_MAX, and `model`'s video projection scaled so that
    its rows enter the stream at RESIDUAL_ENTRY."""
    text = kwargs["encoder_hidden_states"]
    driven = {**kwargs, "encoder_hidden_states": text * (CONTEXT_INPUT_MAX / text.float().abs().max()).to(text.dtype)}
    video = kwargs["hidden_states"].to(model.proj_in.weight.dtype)
    start = model.proj_in(video).abs().max()
    for param in model.proj_in.parameters():
        param.mul_(RESIDUAL_ENTRY / start)
    return driven


@torch.no_grad()
def drive(model: torch.nn.Module, run: Callable[[], object], passes: int = PASSES) -> dict[str, float]:
    """Scale each block branch and its feeder (`FEEDERS`) by a root of what the branch's output lacks of
    BRANCH_TARGET in `run()`, pass after pass; the maxima of a last run."""
    watch = Maxima(model)
    branches = [name for name, _ in model.named_modules() if is_branch(name)]
    for _ in range(passes):
        watch.values.clear()
        run()
        for name in branches:
            kind = next(kind for kind in BRANCHES if name.endswith(kind))
            feeder, root = FEEDERS[kind]
            factor = (BRANCH_TARGET / watch.values[name]) ** root
            model.get_submodule(name).weight.mul_(factor)
            model.get_submodule(name.removesuffix(kind) + feeder).weight.mul_(factor)
    watch.values.clear()
    run()
    watch.remove()
    return watch.summary()


def reached(maxima: dict[str, float]) -> bool:
    """Whether a driven forward reached the report's maxima."""
    return maxima["block"] >= RESIDUAL_MAX and min(maxima[kind] for kind in BRANCHES) >= BRANCH_MAX
