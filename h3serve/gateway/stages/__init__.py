"""The stages a job passes, declared once (stage.py says what a declaration holds).

A workflow's plan names the stages it runs (h3serve/model/workflows); everything per stage (its
queue, metrics labels, stage records, Info) follows from this list. A new stage is one module here and
its name in the plans of the workflows that use it.
"""

from __future__ import annotations

from h3serve.gateway.stages.conditions import ConditionStage
from h3serve.gateway.stages.decode import DecodeStage
from h3serve.gateway.stages.denoise import DenoiseStage
from h3serve.gateway.stages.encoder import EncodeStage
from h3serve.gateway.stages.stage import Stage

STAGES: tuple[type[Stage], ...] = (
    EncodeStage,
    ConditionStage,
    DenoiseStage,
    DecodeStage,
)  # in the order a job meets them
STAGE_NAMES = tuple(stage.name for stage in STAGES)
SERVICES = tuple(dict.fromkeys(stage.service for stage in STAGES))  # the model services the stages call
