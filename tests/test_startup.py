"""A newcomer's first minute: the CLI without optional packages, the two ways of
starting a local run giving the same federation, one-line causes, --version."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import REPO, SMALL, merged, write_config

from fedbus.launch.cli import COMMANDS
from fedbus.launch.processes import start_method
from fedbus.launch.run_cmd import cause

OPTIONAL = ("psutil", "matplotlib", "torchvision", "tensorboard", "hypothesis", "pytest")

# A Python that cannot import the optional packages, as in a fresh venv without extras.
BLOCKED = textwrap.dedent(f"""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {OPTIONAL!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    sys.meta_path.insert(0, Block())
    from fedbus.launch.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def fedbus_blocked(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED, *argv], cwd=REPO, text=True,
                          capture_output=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["--version"]] +
                         [[name, "--help"] for name in COMMANDS] +
                         [["bench", "startup", "--help"], ["bench", "rounds", "--help"]])
def test_every_help_works_without_optional_packages(argv):
    out = fedbus_blocked(*argv)
    assert out.returncode == 0, out.stderr
    assert "usage: fedbus" in out.stdout or out.stdout.startswith("fedbus ")
    assert "Traceback" not in out.stderr


def test_version_names_the_installed_distribution():
    from importlib.metadata import version

    out = fedbus_blocked("--version")
    assert out.stdout.strip() == f"fedbus {version('fedbus')}"


def test_a_command_missing_its_optional_package_says_which_extra():
    out = fedbus_blocked("bench", "rounds", "--clients", "2", "--rounds", "1")
    assert out.returncode == 2
    assert out.stderr.strip() == ("fedbus bench: needs the optional package 'psutil' "
                                  "(pip install 'fedbus[bench]')")


def test_start_method_forks_only_on_linux_cpu_runs():
    linux = sys.platform == "linux"
    assert start_method("auto", ["cpu", "cpu"]) == ("fork" if linux else "exec")
    assert start_method("auto", ["cpu", "cuda:0"]) == "exec"
    assert start_method("exec", ["cpu"]) == "exec"
    assert start_method("fork", ["cuda:0"]) == "fork"  # asked for explicitly


def test_digits_read_without_sklearn_equal_load_digits():
    from sklearn.datasets import load_digits

    from fedbus.node.data.datasets import _digits_arrays

    pixels, labels = _digits_arrays()
    ref = load_digits()
    np.testing.assert_array_equal(pixels, ref.data.astype(np.float32))
    np.testing.assert_array_equal(labels, ref.target)


def test_the_cause_of_a_crash_is_its_exception_line(tmp_path):
    log = tmp_path / "node.log"
    crash = "import json\nlog = 1\njson.loads('{not json')\n"
    with open(log, "w") as f:
        f.write("timestamp='...' level='info' event='node ready'\n")
        f.flush()
        subprocess.run([sys.executable, "-c", crash], stderr=f, check=False)
    assert cause(log).startswith("json.decoder.JSONDecodeError: Expecting property name")
    log.write_text("timestamp='t' level='error' event='no data'\ntimestamp='t' level='info' "
                   "event='bye'\n")
    assert cause(log) == "timestamp='t' level='error' event='no data'"
    assert cause(tmp_path / "absent.log") == "(no log)"


def _run(tmp_path, name: str, start: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cfg = write_config(tmp_path / f"{name}.toml",
                       merged(SMALL, federation={"rounds": 2}, launch={"start": start},
                              algorithm={"name": "fedproto"}))
    run_dir = tmp_path / name
    out = subprocess.run([sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out",
                          str(run_dir)], cwd=REPO, text=True, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out, records


def test_forked_and_execd_processes_run_the_same_federation(tmp_path):
    """Forking from a launcher that loaded torch and the data must change nothing but
    the start-up time: same partition, same initial weights, same training."""
    forked, a = _run(tmp_path, "fork", "fork")
    execd, b = _run(tmp_path, "exec", "exec")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert (ra["bytes_up"], ra["updates"]) == (rb["bytes_up"], rb["updates"])
        assert ra["per_client"] == rb["per_client"]  # every client's own results, exactly
        # the means may differ in the last bit: evaluation results arrive (and are
        # summed) in either order
        for key in ("acc_mean", "proto_acc_mean", "loss_mean"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-12, abs=1e-12), key
    for out, name in ((forked, "fork"), (execd, "exec")):
        assert f"run directory {tmp_path / name}" in out.stderr
        assert f"next: fedbus plot {tmp_path / name}" in out.stderr
        assert "Traceback" not in out.stderr
