"""How far a DiT forward is from fp32: capture one forward's inputs, replay them, compare.

The yardstick is an fp32 forward of the same weights on the same inputs: bf16 eager is itself
~1.4e-2 away from it, so a variant is judged by its own distance next to bf16 eager's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def capture_forward(transformer: torch.nn.Module, run: Callable[[], object]) -> tuple[tuple, dict]:
    """The (args, kwargs) of the first transformer forward that `run` makes, cloned."""
    captured: dict = {}

    def hook(module, args, kwargs):
        if not captured:
            captured["args"], captured["kwargs"] = _clone((args, kwargs))

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return captured["args"], captured["kwargs"]


def forward_output(transformer: torch.nn.Module, inputs: tuple[tuple, dict]) -> torch.Tensor:
    """Video and audio outputs of one forward, flattened into one float32 CPU vector."""
    args, kwargs = inputs
    with torch.no_grad():
        out = transformer(*args, **{**kwargs, "return_dict": False})
    return torch.cat([t.detach().float().flatten().cpu() for t in out])


@contextmanager
def upcast_to_fp32(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` with every weight and buffer in fp32 (no TF32), then put them back.

    bf16 -> fp32 -> bf16 is exact, so the model is unchanged afterwards. Needs room for an fp32
    copy of the weights (123 GiB for the released transformer: fits one H200). Buffers too: they were
    left in fp32 (the VAE decoder's rope frequencies), so every run after this one was not the model
    it timed; on one H200 the compiled VAE after it failed with cuDNN's SDPA finding no kernel (the
    suspected cause, not confirmed there).
    """
    dtypes = {name: t.dtype for name, t in [*model.named_parameters(), *model.named_buffers()]}
    precision = torch.get_float32_matmul_precision()
    model.float()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:  # float() replaced the buffers
            t.data = t.data.to(dtypes[name])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def fp32_output(transformer: torch.nn.Module, inputs: tuple[tuple, dict]) -> torch.Tensor:
    """The captured forward with every weight upcast to fp32."""
    with upcast_to_fp32(transformer):
        return forward_output(transformer, inputs)


def rel_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm())


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, (tuple, list)):
        return type(tree)(_clone(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree
