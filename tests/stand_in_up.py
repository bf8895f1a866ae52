"""`h3serve up` itself (h3serve/cli/up.py, launcher.py, supervise.py), each service started by a stand-in command
instead of `h3serve serve <name>`: `python stand_in_up.py '<{name: argv} as JSON>' up --config ... --log-dir ...`.

The supervision tests run it as a user runs `h3serve up` (signals, the state file, restarts, its own death), over
children that start in well under a second and load no model."""

from __future__ import annotations

import json
import sys

from h3serve.cli import launcher, main

COMMANDS: dict[str, list[str]] = json.loads(sys.argv.pop(1))


class StandIns(launcher.ServiceGroup):
    def _command(self, name: str) -> list[str]:
        return COMMANDS[name]


launcher.ServiceGroup = StandIns  # `up` imports it from there when it runs
main.main()
