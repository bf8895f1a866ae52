"""The request options are declared once (h3serve/model/options.py) and every door offers exactly them: the
`generate` and `reference` flags and the HTTP create body each carry every option of the table, and only those,
into the GenerationParams the gateway resolves. No processes."""

from __future__ import annotations

import pytest

from h3serve.cli import main, request_flags
from h3serve.gateway.http import videos
from h3serve.model import options
from h3serve.v1 import common_pb2, gateway_pb2

# A value for each option's type, as the table's proto field takes it and as a flag / a JSON body writes it.
SAMPLES = {int: (7, "7"), float: (2.5, "2.5"), bool: (True, None), common_pb2.Adapter: (None, "turbo:0.5")}
ADAPTER = common_pb2.Adapter(name="turbo", weight=0.5)


def every_option_set() -> common_pb2.GenerationParams:
    values = {o.name: [ADAPTER] if o.repeated else SAMPLES[o.type][0] for o in options.OPTIONS}
    return options.params(values)


def flags() -> list[str]:
    given = [[o.flag, SAMPLES[o.type][1]] for o in options.OPTIONS if o.cli]
    return [*(item for pair in given for item in pair), "--raw", "raw.npz"]  # --raw FILE asks for include_raw


def option_dests(command: str) -> set[str]:
    parser = main.parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[attr-defined]
    return {a.dest for a in sub._actions} & set(options.FIELDS)


def test_the_table_is_every_field_of_generation_params():
    assert [o.name for o in options.OPTIONS] == list(options.FIELDS)


@pytest.mark.parametrize("command", ["generate", "reference"])
def test_the_cli_offers_exactly_the_tables_options(command):
    assert option_dests(command) == {o.name for o in options.OPTIONS if o.cli}
    args = main.parser().parse_args([command, *flags()])
    assert options.params(request_flags.option_values(args)) == every_option_set()


def test_generate_sends_every_option_in_the_request():
    args = main.parser().parse_args(["generate", *flags()])
    assert request_flags.request(args).params == every_option_set()


def test_the_http_body_offers_exactly_the_tables_options():
    body = {o.http: [ADAPTER.name + ":0.5"] if o.repeated else SAMPLES[o.type][0] for o in options.OPTIONS}
    request = videos.generate_request(videos.VideoCreate.parse({"prompt": "a fox", **body}), "r1")
    assert request.params == every_option_set()
    own = set(videos.VideoFields.model_fields) - {o.http for o in options.OPTIONS}
    assert set(videos.VideoCreate.model_fields) - own == {o.http for o in options.OPTIONS}


def test_the_deprecated_top_level_copies_fold_into_params_and_a_disagreement_names_the_field():
    folded = options.folded(gateway_pb2.GenerateRequest(seed=5, num_inference_steps=4, params={"seed": 5}))
    assert (folded.seed, folded.num_inference_steps) == (5, 4)
    with pytest.raises(options.InvalidRequest, match=r"^seed: set at the top level \(5\) and in params \(6\)"):
        options.folded(gateway_pb2.GenerateRequest(seed=5, params={"seed": 6}))


def test_a_videos_options_make_the_same_request_again():
    request = gateway_pb2.ResolvedRequest(prompt="a fox", num_frames=124, params=every_option_set())
    shown = videos.video(gateway_pb2.Job(job_id="j1", state=gateway_pb2.JOB_STATE_QUEUED, request=request))["h3serve"]
    body = {o.http: shown[o.http] for o in options.OPTIONS}
    again = videos.generate_request(videos.VideoCreate.parse({"prompt": "a fox", **body}), "r2")
    assert again.params == every_option_set()
