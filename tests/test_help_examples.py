"""Every example in every `fedbus ... --help` runs as written: the examples are read from
the real help texts (the "examples:" blocks of each sub-command's and each benchmark's help),
and each is run the cheapest way that still checks it whole: a sweep with --dry-run, which
validates the config of every run of its grid (CONFIG, --set and --grid keys and values,
seeds) as a real sweep does before it starts anything; a table by the real parser, its
RUN directories among those the sweep examples make and its keys and baseline among their
grids. An example of a command this file does not know fails, so a new one gets checked."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from fedbus.launch import cli, sweep_cmd
from fedbus.node.config import SCHEMA, load_config

REPO = Path(__file__).resolve().parent.parent


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return out.getvalue()


def all_helps() -> dict[str, str]:
    """'fedbus CMD [NAME]' -> its --help text, for every sub-command and benchmark."""
    helps = {"fedbus": help_text([])}
    for command in cli.COMMANDS:
        helps[f"fedbus {command}"] = help_text([command])
    from fedbus.launch.bench_cmd import BENCHES

    for name in BENCHES:
        helps[f"fedbus bench {name}"] = help_text(["bench", name])
    return helps


def examples_in(text: str) -> list[list[str]]:
    """The commands of a help text's "examples:" blocks, each as argv after `fedbus`
    (continuation lines joined, comments dropped)."""
    found, block, line = [], False, ""
    for raw in text.splitlines():
        if re.fullmatch(r"examples?:", raw.strip()):
            block = True
            continue
        if block and not raw.strip():
            block = False
        if not block:
            continue
        line += raw.strip()
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        words, line = shlex.split(line, comments=True), ""
        assert words and words[0] == "fedbus", f"an example that is no fedbus command: {raw}"
        found.append(words[1:])
    return found


HELPS = all_helps()
EXAMPLES = [(where, argv) for where, text in HELPS.items() for argv in examples_in(text)]


def call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def option_values(argv: list[str], option: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == option]


def test_the_help_texts_hold_examples():
    """The extraction finds what is there (the sweep's and the table's examples), so the
    checks below cannot pass on nothing."""
    commands = {argv[0] for _, argv in EXAMPLES}
    assert {"sweep", "table"} <= commands, commands
    assert len(EXAMPLES) >= 7


def test_every_help_example_runs_as_written(tmp_path, monkeypatch):
    """From a working directory like a fresh clone's root (examples/ reachable as the help
    writes it, shared/ beside it): sweeps first, then what reads their runs."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    sweeps: dict[str, tuple[set[str], dict[str, list[str]]]] = {}
    order = sorted(EXAMPLES, key=lambda e: e[1][0] != "sweep")
    for where, argv in order:
        command = " ".join(["fedbus", *argv])
        if argv[0] == "sweep":
            code, out, err = call([*argv, "--dry-run"])
            assert code == 0, f"{where}: {command}\n{err}"
            names = set(re.findall(r"^  (\S+): ", out, re.MULTILINE))
            grid = {}
            for axis in option_values(argv, "--grid"):
                key, values = axis.split("=", 1)
                grid[key] = sweep_cmd.split_values(values)
            assert names and grid, f"{where}: {command}: no runs\n{out}"
            sweeps[option_values(argv, "--out")[0]] = (names, grid)
            assert not Path(option_values(argv, "--out")[0]).exists()  # a dry run
        elif argv[0] == "slurm":  # submitted for real by tests/test_slurm.py
            check_slurm_example(where, command, argv)
        elif argv[0] in ("table", "timeline"):  # (timeline's run: tests/test_timeline.py)
            check_table_example(where, command, argv, sweeps)
        else:
            pytest.fail(f"{where}: {command}: an example of a command this test does not "
                        f"check yet: teach it how (run it, or validate its config)")


def check_slurm_example(where: str, command: str, argv: list[str]) -> None:
    """A submission prints its job with --dry-run (the config loaded, the clients split);
    a --resume names a run to resubmit: parsed here, resubmitted in tests/test_slurm.py."""
    if "--resume" in argv:
        cli.build_parser("slurm").parse_args(argv)
        return
    code, out, err = call([*argv] if "--dry-run" in argv else [*argv, "--dry-run"])
    assert code == 0 and "#SBATCH --nodes=" in out, f"{where}: {command}\n{err}"


def check_table_example(where: str, command: str, argv: list[str],
                        sweeps: dict[str, tuple[set[str], dict[str, list[str]]]]) -> None:
    cli.build_parser(argv[0]).parse_args(argv)  # a bad option exits, failing the test
    grid_keys: dict[str, list[str]] = {}
    for run in option_positionals(argv):
        sweep, name = (run, "") if run in sweeps else run.rsplit("/", 1)
        assert sweep in sweeps, f"{where}: {command}: {run} is made by no sweep example"
        names, grid = sweeps[sweep]
        assert not name or name in names, f"{where}: {command}: {sweep} has no run {name}"
        grid_keys.update(grid)
    for key in option_values(argv, "--group-by") + option_values(argv, "--pair-by"):
        section, _, leaf = key.partition(".")
        assert leaf in SCHEMA.get(section, {}), f"{where}: {command}: no key {key}"
    baselines = option_values(argv, "--baseline")
    if baselines:
        first = (option_values(argv, "--group-by") or list(grid_keys))[0]
        assert baselines[0] in grid_keys.get(first, []), \
            f"{where}: {command}: --baseline {baselines[0]} is no value of {first}"


def option_positionals(argv: list[str]) -> list[str]:
    """The RUN arguments of a table example: words that are no option and no option's
    value (every table option takes one value)."""
    words, skip = [], False
    for word in argv[1:]:
        if skip:
            skip = False
        elif word.startswith("--"):
            skip = True
        else:
            words.append(word)
    return words



def readme_first_screen() -> list[list[str]]:
    """The commands of the README's first screen (its sections before "Read next")."""
    text = (REPO / "README.md").read_text()
    screen = text[:text.index("\n## Read next")]
    return [shlex.split(line, comments=True)[1:] for line in screen.splitlines()
            if line.startswith("    fedbus ")]


def test_the_readme_first_screen_runs_as_written(tmp_path, monkeypatch):
    """What a newcomer types first: each run's config loads (--print-config, the config
    the run would use), the sweep validates every run, table and plot parse and read the
    sweep's directory."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    commands = readme_first_screen()
    assert [c[0] for c in commands].count("run") >= 2 and \
        {"sweep", "table", "plot"} <= {c[0] for c in commands}, commands
    sweep_out = None
    for argv in commands:
        command = " ".join(["fedbus", *argv])
        if argv[0] == "run":
            extra = [] if "--help-config" in argv else ["--print-config"]
            code, out, err = call([*argv, *extra])
            assert code == 0 and out, f"README: {command}\n{err}"
            config = [w for w in argv[1:] if w.endswith(".toml")]
            sets = option_values(argv, "--set")
            assert load_config(config[0] if config else None, sets).notes == [], command
        elif argv[0] == "sweep":
            code, out, err = call([*argv, "--dry-run"])
            assert code == 0 and "would run" in out, f"README: {command}\n{err}"
            sweep_out = option_values(argv, "--out")[0]
        else:
            assert argv[0] in ("table", "plot"), f"README: {command}: not checked yet"
            cli.build_parser(argv[0]).parse_args(argv)
            assert sweep_out in option_positionals(argv), f"README: {command}"
