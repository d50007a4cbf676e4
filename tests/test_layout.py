"""The tests' own layout: tests/ mirrors the layers of src/cachepilot/ (tests/core/,
tests/gateway/, …: one folder per package, nested as the packages are), what tests share is
the one package tests/helpers/ (imported as ``helpers``), and no test imports another test
module or a conftest. This file is the one test module directly in tests/.

Besides the layers, tests/ holds only :data:`NOT_LAYERS`. A layer folder holds test modules
and at most a conftest.py (its fixtures); a shared function or class goes to helpers/.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src" / "cachepilot"
# The folders of tests/ that are no layer, and why.
NOT_LAYERS = {"helpers": "what tests share (polling, routers, the cluster, fixtures' code)",
              "data": "vectors and captures the tests read"}
TOP_LEVEL = {"test_layout.py", "conftest.py"}  # the only .py files directly in tests/
SKIP = {"__pycache__"}


def _dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.rglob("*") if d.is_dir()
                  and not any(p in SKIP or p.startswith(".") for p in d.relative_to(root).parts))


def _layers(src: Path) -> list[Path]:
    """Every package under ``src`` (relative), nested ones too."""
    return sorted(d.relative_to(src) for d in _dirs(src) if (d / "__init__.py").exists())


def layout_problems(tests: Path, src: Path) -> list[str]:
    """What in ``tests`` breaks the layout rules (empty: nothing)."""
    out = []
    layers = set(_layers(src))
    for f in sorted(tests.glob("*.py")):
        if f.name not in TOP_LEVEL:
            out.append(f"{f.name}: directly in tests/ (a test goes in its layer's folder, "
                       "shared code in helpers/)")
    for d in _dirs(tests):
        rel = d.relative_to(tests)
        if rel.parts[0] in NOT_LAYERS:
            if rel.parts[0] == "helpers":
                out += [f"{f.relative_to(tests)}: a test module or conftest in helpers/"
                        for f in sorted(d.glob("*.py"))
                        if f.name.startswith("test_") or f.name == "conftest.py"]
            continue
        if rel not in layers:
            out.append(f"{rel}/: no package src/cachepilot/{rel}/ (a folder of tests mirrors "
                       f"a layer, or is one of {sorted(NOT_LAYERS)})")
        out += [f"{f.relative_to(tests)}: neither a test module nor a conftest (shared code "
                "goes in helpers/)" for f in sorted(d.glob("*.py"))
                if not f.name.startswith("test_") and f.name != "conftest.py"]
    for layer in sorted(layers):
        if len(layer.parts) == 1 and not (tests / layer).is_dir():
            out.append(f"{layer}/: the layer src/cachepilot/{layer}/ has no folder of tests")
    return out


def _imported(node: ast.AST) -> list[tuple[str, int]]:
    """The modules a node imports (absolute names; a relative one as its dots and name) and
    the names a relative ``from . import`` takes, with the import's level."""
    if isinstance(node, ast.Import):
        return [(a.name, 0) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        mods = [(node.module or "", node.level)]
        if node.level or node.module in (None, "tests"):
            mods += [(f"{node.module}.{a.name}" if node.module else a.name, node.level)
                     for a in node.names]
        return mods
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("import_module", "__import__"):
            return [(node.args[0].value, 0)]
    if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets):
        values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) \
            else [node.value]
        return [(v.value, 0) for v in values
                if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def import_problems(tests: Path) -> list[str]:
    """Imports in ``tests`` of a test module or a conftest (or of anything through the
    ``tests`` package: helpers are imported as ``helpers``)."""
    modules = [f for f in sorted(tests.rglob("*.py"))
               if not any(p in SKIP or p in ("data",) for p in f.relative_to(tests).parts)]
    stems = {f.stem for f in modules if f.name.startswith("test_")} | {"conftest"}
    folders = {d.name for d in _dirs(tests)}
    out = []
    for f in modules:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            for name, level in _imported(node):
                parts = name.split(".") if name else []
                bad = (bool(parts) and (parts[0] in stems or parts[0] == "tests"
                                        or (parts[0] in folders
                                            and any(p in stems for p in parts[1:]))
                                        or (level > 0 and any(p in stems for p in parts))))
                if bad:
                    out.append(f"{f.relative_to(tests)}:{node.lineno}: imports "
                               f"{'.' * level}{name} (shared code goes in helpers/)")
    return out


def test_the_tests_mirror_the_layers() -> None:
    problems = layout_problems(TESTS, SRC)
    assert not problems, "\n".join(problems)


def test_no_test_imports_another_test_module_or_a_conftest() -> None:
    problems = import_problems(TESTS)
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    """Each rule on a tree that breaks it: the checks above can fail."""
    src, tests = tmp_path / "src", tmp_path / "tests"
    for pkg in ("core", "core/flow", "gateway", "empty"):
        (src / pkg).mkdir(parents=True)
        (src / pkg / "__init__.py").write_text("")
    files = {
        "test_layout.py": "",
        "test_stray.py": "",  # a test directly in tests/
        "shared.py": "",  # shared code outside helpers/
        "core/test_a.py": "from test_b import x\nimport conftest\n",
        "core/flow/test_f.py": "from core.test_a import y\n",  # nested, mirrors core/flow
        "core/conftest.py": "pytest_plugins = ['core.test_a']\n",
        "core/util.py": "",  # shared code in a layer folder
        "gateway/test_b.py": ("import importlib\nfrom tests.helpers import polling\n"
                              "def f():\n    return importlib.import_module('test_a')\n"),
        "gateway/test_c.py": "from aiohttp.test_utils import TestServer\nimport operator\n",
        "nolayer/test_d.py": "",  # a folder without a package
        "helpers/__init__.py": "",
        "helpers/kube.py": "from helpers.polling import until\n",
        "helpers/test_e.py": "",  # a test module in helpers/
        "data/x.py": "import test_a\n",  # data is not checked
    }
    for name, text in files.items():
        (tests / name).parent.mkdir(parents=True, exist_ok=True)
        (tests / name).write_text(text)
    layout = "\n".join(layout_problems(tests, src))
    for expected in ("test_stray.py: directly", "shared.py: directly", "nolayer/: no package",
                     "core/util.py: neither", "helpers/test_e.py: a test module",
                     "empty/: the layer"):
        assert expected in layout, (expected, layout)
    assert "core/flow" not in layout and "gateway/" not in layout
    imports = "\n".join(import_problems(tests))
    for expected in ("core/test_a.py:1: imports test_b", "core/test_a.py:2: imports conftest",
                     "core/flow/test_f.py:1: imports core.test_a",
                     "core/conftest.py:1: imports core.test_a",
                     "gateway/test_b.py:2: imports tests.helpers",
                     "gateway/test_b.py:4: imports test_a"):
        assert expected in imports, (expected, imports)
    assert "test_c.py" not in imports and "helpers/kube.py" not in imports
    assert "data/" not in imports
