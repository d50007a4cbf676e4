"""``cachepilot experiment``: the studies load only when their command runs, yet every
default shown is the study's own; the command line written into a study's folder
reproduces the run; a missing optional extra ends in one line naming it."""

from __future__ import annotations

import shlex
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from cachepilot.cli import main
from cachepilot.cli.experiments import experiment_group
from cachepilot.cli.study_options import command_line, require_extra


def _ctx(name: str, args: list[str]) -> click.Context:
    """The command's context after parsing ``args`` (defaults and callbacks applied)."""
    command = experiment_group.commands[name]
    parent = click.Context(experiment_group, info_name="experiment",
                           parent=click.Context(main, info_name="cachepilot"))
    return command.make_context(name, args, parent=parent)


def test_listing_the_studies_imports_none() -> None:
    code = ("import sys; from click.testing import CliRunner; from cachepilot.cli import main; "
            "r = CliRunner().invoke(main, ['experiment', '--help']); "
            "print(r.exit_code, sorted(m for m in sys.modules if m.startswith('cachepilot.lab')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split(maxsplit=1) == ["0", "[]\n"], out.stdout + out.stderr


def test_defaults_are_the_studies_own() -> None:
    from cachepilot.lab import real_peers, real_traffic, vllm_chat_study, vllm_study
    from cachepilot.tooling.llamacpp import LlamaWorkerSpec

    peers = _ctx("real-peers", []).params
    assert peers["workloads"] == list(real_peers.WORKLOADS)
    assert peers["routers"] == list(real_peers.DEFAULT_ROUTERS)
    assert peers["requests"] == real_peers.StudyConfig.requests
    model = _ctx("real-model", []).params
    assert (model["rate"], model["groups"], model["seed"]) == (
        real_traffic.WORKLOAD.rate, real_traffic.WORKLOAD.groups, real_traffic.SEED)
    assert (model["slots"], model["cache_ram_mib"]) == (LlamaWorkerSpec.parallel,
                                                        LlamaWorkerSpec.cache_ram_mib)
    shown = CliRunner().invoke(main, ["experiment", "real-model", "--help"]).output
    assert (f"[default: {real_traffic.REQUESTS}; vllm: {vllm_study.StudyConfig.requests} per "
            f"phase, with --api chat {vllm_chat_study.ChatStudyConfig.requests}]"
            ) in " ".join(shown.split())
    bad = CliRunner().invoke(main, ["experiment", "real-peers", "--routers", "cachepilot,nope"])
    assert bad.exit_code == 2 and "nope: choose from cachepilot, round_robin" in bad.output


@pytest.mark.parametrize(("name", "args"), [
    ("peers", ["--seeds", "3", "--out", "/tmp/p"]),
    ("real-peers", ["--workloads", "hotspot", "--rate", "0.5", "--seeds", "2"]),
    ("real-model", ["--engine", "vllm", "--outside", "0.2", "--json"]),
    ("real-model", ["--engine", "vllm", "--api", "chat", "--outside", "0.3"]),
])
def test_the_written_command_reproduces_the_run(name: str, args: list[str]) -> None:
    ctx = _ctx(name, args)
    line = command_line(ctx)
    argv = shlex.split(line)
    assert argv[:3] == ["cachepilot", "experiment", name]
    again = _ctx(name, argv[3:])
    assert again.params == ctx.params
    assert command_line(again) == line


def test_the_written_command_names_cachepilot_however_it_ran() -> None:
    """``python -m cachepilot …`` names its root ``python -m cachepilot``: the command
    written is still ``cachepilot experiment …``."""
    command = experiment_group.commands["real-model"]
    root = click.Context(main, info_name="python -m cachepilot")
    ctx = command.make_context("real-model", ["--engine", "vllm", "--api", "chat"],
                               parent=click.Context(experiment_group, info_name="experiment",
                                                    parent=root))
    assert command_line(ctx).startswith("cachepilot experiment real-model --engine vllm "
                                        "--api chat ")


def test_a_missing_extra_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    require_extra("vllm", "json")  # present: nothing to say
    with pytest.raises(click.ClickException, match=r"needs no_such_mod: pip install "
                                                   r"'cachepilot\[vllm\]'"):
        require_extra("vllm", "no_such_mod")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "httpx" else real(n, *a))
    res = CliRunner().invoke(main, ["experiment", "real-model", "--engine", "vllm"])
    assert res.exit_code == 1 and res.exception is not None
    assert res.output.strip() == ("Error: this study needs httpx: pip install "
                                  "'cachepilot[vllm]'")
