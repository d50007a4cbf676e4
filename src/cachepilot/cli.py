"""The ``cachepilot`` command. Each subcommand lives beside the code it drives and is imported
only when used, so ``cachepilot sim-worker`` does not pay for gRPC or kopf imports."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click

# name → "module:attribute" of a click command. Add a line here for a new subcommand.
COMMANDS: dict[str, str] = {
    "sim-worker": "cachepilot.worker.server:sim_worker_cmd",
    "gateway": "cachepilot_extproc.cli:gateway_cmd",
    "envoy-config": "cachepilot_extproc.cli:envoy_config_cmd",
    "up": "cachepilot_extproc.stack:up_cmd",
    "demo": "cachepilot_extproc.demo:demo_cmd",
    "simulate": "cachepilot.sim.cli:simulate_cmd",
    "experiment": "cachepilot.sim.cli:experiment_group",
    "explain": "cachepilot.record.cli:explain_cmd",
    "replay": "cachepilot.record.cli:replay_cmd",
    "decisions": "cachepilot.record.cli:decisions_group",
}


class LazyGroup(click.Group):
    """A group whose ``lazy`` subcommands ("module:attribute") are imported when invoked."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = self.lazy.get(name)
        if target is None:
            return super().get_command(ctx, name)
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.version_option(package_name="cachepilot")
def main() -> None:
    """CachePilot: route LLM requests to the worker that holds their prefix, priced in ms."""
