"""diffusers' MiniMax-H3 denoise loop with one more sub-block that observes every step.

The observer runs after the scheduler update of each iteration, so it sees finished steps,
and it is the cancellation point: raising from it ends the loop at a step boundary. The
other sub-blocks are diffusers' own, so the numbers are exactly the reference pipeline's.
"""

from __future__ import annotations

from collections.abc import Callable

from diffusers.modular_pipelines import ModularPipelineBlocks
from diffusers.modular_pipelines.modular_pipeline_utils import InputParam

StepObserver = Callable[[int, int], None]
"""Called as observer(step, total) after each forward; step is 1-based."""


class StepObserverBlock(ModularPipelineBlocks):
    # diffusers declares `model_name = None` unannotated, so a type checker takes its type as None; its blocks set a str
    model_name = "minimax-h3"  # type: ignore[assignment]

    @property
    def description(self) -> str:
        return "Reports each finished denoise step to the serving loop, which may stop the loop here."

    @property
    def inputs(self) -> list[InputParam]:
        return [
            InputParam("step_observer", required=True, description="Callable (step, total) run after each step."),
            InputParam("timesteps", required=True, description="Timesteps of the video schedule."),
        ]

    def __call__(self, components, block_state, i: int, t):
        block_state.step_observer(i + 1, len(block_state.timesteps))
        return components, block_state


def observed(core):
    """A workflow's core denoise step with its loop (`denoise`) extended by the step observer."""
    loop = type(core.sub_blocks["denoise"])
    observed_loop = type(
        f"Observed{loop.__name__}",
        (loop,),
        {
            "block_classes": [*loop.block_classes, StepObserverBlock],
            "block_names": [*loop.block_names, "observe"],
        },
    )
    core.sub_blocks["denoise"] = observed_loop()
    return core
