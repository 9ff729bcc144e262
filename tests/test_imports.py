"""Imports point one way (README, "Layout"), checked by import-linter's `lint-imports`
with the contracts in pyproject.toml's [tool.importlinter]: the real command passes on
the repository, and fails, naming the contract and the import, on a copy of the package
with one import that points the wrong way."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

pytest.importorskip("importlinter")  # the dev extra installs it

# the folders installed as fedbus.<folder> (pyproject.toml [tool.setuptools.package-dir])
PACKAGES = ("broker", "node", "algorithms", "models", "launch", "bench")


def lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    # --no-cache: nothing is written into the tree
    return subprocess.run([*cmd, "--no-cache", "--no-logo"], cwd=cwd, env=env, check=False,
                          text=True, capture_output=True, timeout=120)


def test_lint_imports_passes_on_the_repository():
    out = lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 broken." in out.stdout, out.stdout


def test_an_upward_import_breaks_its_contract(tmp_path):
    """A copy of the package, laid out as installed (tmp/fedbus/<folder>) and first on
    PYTHONPATH, with an algorithm importing the node and a broker module importing an
    algorithm: lint-imports exits non-zero and names both contracts and both imports."""
    root = tmp_path / "fedbus"  # a namespace package, as installed: no __init__.py
    for name in PACKAGES:
        shutil.copytree(REPO / name, root / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (root / "algorithms" / "upward_probe.py").write_text(
        "def config():\n    from fedbus.node.config import load_config  # lazy: still counts\n"
        "    return load_config(None)\n")
    (root / "broker" / "upward_probe.py").write_text("import fedbus.algorithms.merge\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}

    out = lint_imports(tmp_path, env)
    report = out.stdout + out.stderr
    assert out.returncode == 1, report
    # the copy was analysed, not the installed package: the added imports are named
    assert "fedbus.algorithms.upward_probe -> fedbus.node.config (l.2)" in report, report
    assert "fedbus.broker.upward_probe -> fedbus.algorithms.merge (l.1)" in report, report
    assert "fedbus.algorithms is not allowed to import fedbus.node" in report, report
    assert "bench -> launch -> node -> algorithms -> models, never upwards BROKEN" in report
    assert "the broker imports no engine, no algorithm, no model, no launcher BROKEN" in report
    assert "algorithms and models do not import the bus KEPT" in report
