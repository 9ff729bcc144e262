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
PACKAGES = ("broker", "node", "record", "analysis", "algorithms", "models", "launch", "bench")


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
    (root / "broker" / "upward_probe.py").write_text("import fedbus.algorithms.core.merge\n")
    (root / "record" / "upward_probe.py").write_text("import fedbus.analysis.plots\n")
    (root / "algorithms" / "core" / "upward_probe.py").write_text(
        "from fedbus.algorithms.fedavg import FedAvgServer\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}

    out = lint_imports(tmp_path, env)
    report = out.stdout + out.stderr
    assert out.returncode == 1, report
    # the copy was analysed, not the installed package: the added imports are named
    assert "fedbus.algorithms.upward_probe -> fedbus.node.config (l.2)" in report, report
    assert "fedbus.broker.upward_probe -> fedbus.algorithms.core.merge (l.1)" in report, report
    assert "fedbus.algorithms is not allowed to import fedbus.node" in report, report
    assert "fedbus.record.upward_probe -> fedbus.analysis.plots (l.1)" in report, report
    assert "fedbus.algorithms.core.upward_probe -> fedbus.algorithms.fedavg (l.1)" in report
    assert "one way: bench, launch, analysis, node, algorithms|record, models BROKEN" in report
    assert "the broker imports no engine, no algorithm, no model, no launcher BROKEN" in report
    assert "the algorithms' shared machinery imports no algorithm module BROKEN" in report
    assert "algorithms and models do not import the bus KEPT" in report


def test_the_core_contract_names_every_builtin_algorithm_module():
    """The "core" contract lists the algorithm modules by hand: it must name each module of
    the registry, or a new algorithm would escape it."""
    import tomllib

    from fedbus.algorithms import BUILTIN

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    core = next(c for c in contracts["contracts"] if c["id"] == "core")
    assert sorted(core["forbidden_modules"]) == sorted(BUILTIN.values())


@pytest.mark.parametrize("old, new", [
    ("fedbus.node.replay", "fedbus.analysis.replay"),
    ("fedbus.node.plots", "fedbus.analysis.plots"),
    ("fedbus.node.rundir", "fedbus.record.rundir"),
    ("fedbus.node.msglog", "fedbus.record.msglog"),
    ("fedbus.node.dp", "fedbus.node.privacy.dp"),
    ("fedbus.node.secure_round", "fedbus.node.privacy.secure_round"),
    ("fedbus.algorithms.protos", "fedbus.algorithms.core.protos"),
    ("fedbus.algorithms.merge", "fedbus.algorithms.core.merge"),
    ("fedbus.algorithms.params", "fedbus.algorithms.core.params"),
    ("fedbus.algorithms.aux_model", "fedbus.algorithms.fml"),
])
def test_a_moved_module_imports_under_its_old_name_with_a_warning(old, new):
    """In a fresh interpreter (the import system caches): the old name gives the moved
    module itself and warns once, naming the new home."""
    code = (f"import warnings, importlib, sys\n"
            f"with warnings.catch_warnings(record=True) as w:\n"
            f"    warnings.simplefilter('always')\n"
            f"    old = importlib.import_module({old!r})\n"
            f"new = importlib.import_module({new!r})\n"
            f"assert old is new, (old, new)\n"
            f"assert new.__spec__.name == {new!r}, new.__spec__\n"
            f"msgs = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
            f"assert msgs == [{old!r} + ' moved to ' + {new!r} + '; import it from there'], msgs\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def test_old_names_of_split_modules_still_resolve():
    """fedbus.algorithms.base held the handlers and the metrics; fedbus.algorithms.local held
    opt/Params/LocalClient; fedbus.node.privacy held protect: each name is the same object
    under its old module."""
    import warnings

    from fedbus.algorithms.core import handlers, metrics, params, training
    from fedbus.node.privacy import prototypes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fedbus.algorithms import base, local
        from fedbus.node.privacy import protect
    assert base.ServerHandler is handlers.ServerHandler
    assert base.LocalRun is handlers.LocalRun
    assert base.head_metrics is metrics.head_metrics
    assert base.confusion_matrix is metrics.confusion_matrix
    assert local.opt is params.opt and local.Params is params.Params
    assert local.LocalClient is training.LocalClient
    assert protect is prototypes.protect
