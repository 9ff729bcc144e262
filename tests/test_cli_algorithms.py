"""Every option findable from the command line (issue 24, item 6): `fedbus run --help-config`
lists the chosen algorithm's parameters, `fedbus algorithms` lists the registered
algorithms (plugins included) and one algorithm's options, and `fedbus --help` /
`fedbus bench --help` name every sub-command their registries hold. Real CLI processes."""
from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO, fedbus, write_config
from test_plugins import _install_plugin

from fedbus.algorithms import available, get_algorithm
from fedbus.launch.bench_cmd import BENCHES
from fedbus.launch.cli import COMMANDS


def _section(text: str, name: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(f"[{name}]")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")),
               len(lines))
    return lines[start + 1:end]


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedbus.launch", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)


def test_help_config_lists_the_chosen_algorithms_parameters():
    out = fedbus("run", "--help-config", "--set", "algorithm.name=fedtgp", timeout=120).stdout
    algo = _section(out, "algorithm")
    assert any(line.startswith("  # parameters of fedtgp (--set algorithm.name)")
               for line in algo), algo
    params = get_algorithm("fedtgp").server.PARAMS  # (help texts change: read them here)
    epochs = params["server_epochs"]
    assert f"  server_epochs = 100  # {epochs.help} (>= {epochs.min})" in algo
    # allowed values, and every declared parameter has its line
    assert any(line.startswith("  generator = 'mlp'") and "(one of mlp, none)" in line
               for line in algo)
    assert {line.split(" = ")[0].strip() for line in algo if " = " in line
            and not line.lstrip().startswith("#")} == {"name", *params}
    # every other section is still listed
    assert {"[federation]", "[data]", "[train]", "[algorithm]"} <= set(out.splitlines())


def test_help_config_of_a_config_file_naming_a_plugin_algorithm(tmp_path):
    env = _install_plugin(tmp_path)
    cfg = write_config(tmp_path / "c.toml", {"algorithm": {"name": "halfstep"}})
    algo = _section(_cli("run", str(cfg), "--help-config", env=env).stdout, "algorithm")
    assert any(line.startswith("  # parameters of halfstep (") and "[algorithm] name" in line
               for line in algo), algo
    assert "  step = 0.5" in algo  # a bare default: no help, no bounds


def test_help_config_without_a_choice_says_the_default_algorithm():
    algo = _section(fedbus("run", "--help-config", timeout=120).stdout, "algorithm")
    assert any(line.startswith("  # parameters of fedproto (the default algorithm)")
               for line in algo), algo
    lam = get_algorithm("fedproto").server.PARAMS["lam"]
    assert any(line.startswith(f"  lam = {lam.default!r}  # {lam.help}") for line in algo)


def test_help_config_with_an_unknown_algorithm_is_one_line_and_exit_2():
    proc = fedbus("run", "--help-config", "--set", "algorithm.name=nope", check=False,
                  timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "fedbus: config error: algorithm.name = 'nope': unknown algorithm 'nope'"), proc.stderr


def test_algorithms_lists_every_registered_one_plugins_included(tmp_path):
    records = json.loads(_cli("algorithms", "--json", env=_install_plugin(tmp_path)).stdout)
    assert all("error" not in r and "text" in r["uploads"] for r in records), \
        [r for r in records if "error" in r or "error" in r.get("uploads", {})]
    assert [r["name"] for r in records] == sorted({*available(), "halfstep"})
    by_name = {r["name"]: r for r in records}
    assert by_name["halfstep"]["summary"] == "FedAvg with a damped step"
    assert by_name["fedproto"]["summary"].startswith("FedProto (Tan et al. 2022)")
    # digits: 10 classes, the cnn's 50 features
    assert by_name["fedproto"]["uploads"]["spec"]["protos"] == {"dtype": "float32",
                                                                "shape": [10, 50]}
    assert by_name["fedproto"]["merge"] == "prototype-sums"
    assert by_name["fedavg"]["dp_levels"] == ["client", "sgd"]
    assert by_name["fedtgp"]["options"] == len(get_algorithm("fedtgp").server.PARAMS)


def test_algorithms_text_listing_names_each(capsys):
    from fedbus.launch.cli import main  # the CLI's entry point, in this process (cheaper)

    assert main(["algorithms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in lines[1:] if line[:1].strip()} == set(available())
    assert "  uploads: protos float32[10x50]" in \
        next(x for i, x in enumerate(lines) if i and lines[i - 1].startswith("fedproto "))


def test_algorithms_name_prints_every_option():
    one = json.loads(fedbus("algorithms", "fedproto", "--json", timeout=120).stdout)
    params = get_algorithm("fedproto").server.PARAMS
    assert set(one["params"]) == set(params)
    assert one["params"]["lam"]["default"] == params["lam"].default
    assert one["params"]["lam"]["help"] == params["lam"].help
    assert one["params"]["aggregate"]["choices"] == list(params["aggregate"].choices)
    assert "AAAI 2022" in one["doc"]  # the paper, from the module docstring's opening

    proc = fedbus("algorithms", "nope", check=False, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def _listed(help_text: str) -> dict[str, str]:
    """argparse's sub-command listing: {name: its help, lines joined}."""
    out: dict[str, str] = {}
    name = None
    for line in help_text.split("positional arguments:", 1)[1].split("\noptions:")[0] \
            .splitlines():
        if line.startswith("    ") and line[4:5].strip():
            name, _, rest = line[4:].partition(" ")
            out[name] = rest.strip()
        elif name is not None and line.strip():
            out[name] = f"{out[name]} {line.strip()}".strip()
    return out


def test_help_names_every_command_and_every_bench():
    top = _listed(fedbus("--help", timeout=60).stdout)
    assert set(COMMANDS) <= set(top)
    assert top["bench"] == f"benchmarks: {', '.join(BENCHES)}"
    assert {"secagg", "attack", "train", "segmentation"} <= set(BENCHES)

    bench = _listed(fedbus("bench", "--help", timeout=60).stdout)
    assert set(bench) == set(BENCHES)
