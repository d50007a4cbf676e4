"""The top-level deploy folders (extproc/, operator/) and every generated file: each equal to
its generator's output, the generator's check able to fail, the Envoy files what
`cachepilot envoy-config` prints, the RBAC valid Kubernetes, and neither folder something
Python could import in place of a module (``operator`` is the standard library's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from cachepilot.cli import main as cli
from cachepilot.deploy import generate
from cachepilot.operator import crd

from helpers.paths import ROOT

DEPLOY_FOLDERS = (ROOT / "extproc", ROOT / "operator")


def _body(path: Path) -> str:
    """A generated file without its leading comment lines."""
    return "".join(line for line in path.read_text().splitlines(keepends=True)
                   if not line.startswith("#"))


def test_generated_files_are_current() -> None:
    assert generate.stale_files() == [], "run: python -m cachepilot.deploy.generate --write"
    crds = {p.read_text() for p in (ROOT / "manifests/crd.yaml", ROOT / "operator/crd.yaml",
                                    ROOT / "charts/cachepilot/files/crd.yaml")}
    assert crds == {crd.render_yaml()}
    assert set(generate.outputs()) >= {ROOT / "extproc/envoy.yaml", ROOT / "extproc/envoy-epp.yaml",
                                       ROOT / "operator/crd.yaml", ROOT / "operator/rbac.yaml"}


def test_the_check_reports_a_drifted_file_and_write_repairs_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "extproc" / "envoy.yaml"
    monkeypatch.setattr(generate, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(generate, "outputs", lambda: {target: generate.envoy_yaml})
    assert generate.stale_files() == [target]  # missing
    assert generate.main(["--check"]) == 1
    assert generate.main(["--write"]) == 0 and generate.stale_files() == []
    target.write_text(target.read_text().replace("8080", "8081"))
    assert generate.stale_files() == [target]  # edited by hand


@pytest.mark.parametrize(("name", "args"), [("envoy.yaml", []), ("envoy-epp.yaml", ["--epp"])])
def test_extproc_bootstraps_are_what_envoy_config_prints(name: str, args: list[str]) -> None:
    res = CliRunner().invoke(cli, ["envoy-config", *args])
    assert res.exit_code == 0, res.output
    assert _body(ROOT / "extproc" / name) == res.output


def test_operator_rbac_is_the_charts_and_valid_kubernetes() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / "operator/rbac.yaml").read_text()) if d]
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "Lease"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
        assert "app.kubernetes.io/managed-by" not in doc["metadata"]["labels"]
    role, binding, lease = docs[1], docs[2], docs[3]
    assert binding["subjects"][0]["name"] == docs[0]["metadata"]["name"]
    leases = next(r for r in role["rules"] if r["resources"] == ["leases"])
    assert leases["resourceNames"] == [lease["metadata"]["name"]]
    assert "create" not in leases["verbs"]  # the chart owns the Lease


def test_deploy_folders_hold_nothing_python_can_import() -> None:
    for folder in DEPLOY_FOLDERS:
        assert (folder / "README.md").exists()
        assert not [p for p in folder.rglob("*.py")], f"{folder.name}/ holds Python"
    # With the repository root first on the path (python -m pytest, python -c from the root),
    # `import operator` must still be the standard library's.
    out = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                          "sys.modules.pop('operator', None); import operator; "
                          "print(operator.__file__, operator.itemgetter)", str(ROOT)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not out.stdout.startswith(str(ROOT)), out.stdout
