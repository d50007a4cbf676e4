"""Mistakes on the command line end in one line (``Error: …`` on stderr, non-zero exit), not
a traceback; and the command tree: every command in cachepilot.cli, imported lazily."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from cachepilot.cli import COMMANDS, main
from cachepilot.core.policies import LIVE_POLICIES


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def one_line_error(out: Result, *needles: str) -> str:
    """The result failed with an ``Error: …`` line naming ``needles``, and no traceback."""
    assert out.exit_code != 0, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception
    text = out.stderr if hasattr(out, "stderr") and out.stderr else out.output
    assert "Traceback" not in text
    errors = [ln for ln in text.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, text
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_every_command_lives_in_the_cli_package() -> None:
    assert all(target.startswith("cachepilot.cli.") for target in COMMANDS.values())
    out = run("--help")
    assert out.exit_code == 0
    for name in COMMANDS:
        assert name in out.output


def test_sim_worker_imports_neither_grpc_nor_kopf() -> None:
    code = ("import sys\nfrom cachepilot.cli import main\n"
            "try:\n    main(['sim-worker', '--help'])\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('grpc', 'kopf')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_simulate_trace_in_the_wrong_format(tmp_path: Path) -> None:
    csv = tmp_path / "trace.csv"
    csv.write_text("t,prompt\n0.1,hello\n")
    one_line_error(run("simulate", "--workload", "trace", "--trace", str(csv)),
                   "--trace", "not a JSON object")
    no_time = tmp_path / "trace.jsonl"
    no_time.write_text('{"segments": [["a", 16]]}\n')
    one_line_error(run("simulate", "--workload", "trace", "--trace", str(no_time)),
                   "--trace", "no known trace format")
    one_line_error(run("simulate", "--workload", "trace"), "--trace")


def test_envoy_config_ext_proc_not_host_port() -> None:
    one_line_error(run("envoy-config", "--ext-proc", "nothostport"), "--ext-proc",
                   "host:port")
    one_line_error(run("envoy-config", "--fallback", "a:1,b"), "--fallback")


@pytest.mark.parametrize("command", ["up", "gateway", "simulate", "replay"])
def test_policy_lists_its_choices(command: str) -> None:
    args = [command, "--policy", "nosuch"] + (["log"] if command == "replay" else [])
    line = one_line_error(run(*args), "--policy", "nosuch")
    for name in LIVE_POLICIES:
        assert name in line
    help_text = run(command, "--help").output
    assert "priced|" in help_text or "|priced" in help_text


def test_up_when_its_port_is_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_line_error(run("up", "--port", str(port)), f"port {port}", "in use", "--port")


@pytest.mark.parametrize("args", [
    ["up", "--weights", "load=x"],
    ["up", "--weights", "speed=2"],
    ["gateway", "--weights", "nosuch=1"],
    ["gateway", "--cost", "nosuch=1"],
    ["simulate", "--cost", "max_batch=many"],
    ["simulate", "--cost", "max_batch=1.5"],
    ["replay", "log", "--weights", "prefill"],
])
def test_bad_weights_and_cost(args: list[str]) -> None:
    one_line_error(run(*args), "--weights" if "--weights" in args else "--cost")


def test_gateway_bad_addresses_and_busy_ports() -> None:
    one_line_error(run("gateway", "--workers", "10.0.0.1"), "--workers", "host:port")
    one_line_error(run("gateway", "--listen", "9002"), "--listen")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_line_error(run("gateway", "--admin-port", str(port)), f"port {port}", "in use")


def test_missing_decision_log(tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing-here")
    one_line_error(run("explain", "last", "--log", missing), missing)
    one_line_error(run("decisions", "stats", missing), missing)
    one_line_error(run("decisions", "list", missing), missing)
    one_line_error(run("replay", missing), missing)


def test_explain_help_names_the_response_header() -> None:
    from cachepilot.gateway.protocol import DECISION_HEADER

    out = run("explain", "--help")
    assert out.exit_code == 0 and DECISION_HEADER in out.output


def test_a_subprocess_error_is_one_line_on_stderr() -> None:
    proc = subprocess.run([sys.executable, "-m", "cachepilot", "envoy-config", "--ext-proc",
                           "nothostport"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("Error:")
