"""The rank side of tests/test_int8_group.py: 2 CPU ranks (gloo) load the tiny model directory's transformer with
int8 block weights (`weights = "int8"`) as the service does, each quantising only its FSDP2 rows from the files
(parallel.load_sharded), and run a request; rank 0 compares the latents with the same model loaded whole on one
rank and converted there, and writes what it saw to OUT.json.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.int8_group_checks OUT.json MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.models import ModelSource
from h3serve.services.dit import parallel
from h3serve.services.dit.group import JOB, ControlPlane, GroupMember, Message
from h3serve.services.dit.runner import SCHEDULERS, DenoiseRunner
from tests.dist_checks import CPU, JOB_SPEC, T2VA, inputs, max_diff, run

INT8 = FastPath("native", linears="fp16_scaled", weights="int8")
TOKENS = 11


def main(out_path: str, model_dir: str) -> None:
    control = ControlPlane(parallel.init_groups(CPU, timeout_s=120))
    source = ModelSource(model_dir)
    reference = None
    if control.rank == 0:
        whole = source.load(["transformer", *SCHEDULERS], "cpu", "bfloat16")
        parallel.ready_model(whole["transformer"], INT8, CPU, torch.bfloat16)
        reference = DenoiseRunner(whole, [T2VA]).run(JOB_SPEC, *inputs(TOKENS).values(), lambda step, total: None)
    transformer = parallel.load_sharded(
        source.weights("transformer"), parallel.Layout(2, 2, 1, True), INT8, CPU, torch.bfloat16
    )
    parts = {"transformer": transformer, **source.load(SCHEDULERS, "cpu", "bfloat16")}
    member = GroupMember(control, DenoiseRunner(parts, [T2VA]), CPU, "native", max_math_tokens=4096)
    latents = run(member, Message(JOB, JOB_SPEC, inputs(TOKENS)) if control.rank == 0 else None).latents
    transformer.reshard()  # FSDP2 leaves the root's own parameters gathered after a forward
    shards = {name: p.to_local() for name, p in transformer.named_parameters()}
    block = "transformer_blocks.0.ff.net.2."
    report = {
        "max_diff": max_diff(latents, reference),
        "finite": bool(all(latents[k].isfinite().all() for k in ("latents", "audio_latents"))),
        "block_linear": [str(shards[block + "weight"].dtype), str(shards[block + "weight_scale"].dtype)],
        "rows_per_rank": control.gather(shards[block + "weight"].shape[0]),
    }
    if control.rank == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.barrier()  # without it gloo teardown sometimes aborts
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
