"""`fedbus algorithms [NAME]`: the registered algorithms (built-in and plugins of the
`fedbus.algorithms` entry-point group), each with its paper, what its clients upload and
its options; with NAME, every option of that one. Also the [algorithm] part of
`fedbus run --help-config`.

Everything is read from the registry (fedbus.algorithms): an algorithm's options are its
server class's PARAMS (an Opt-like object with default, help, choices, min and max, or a
bare default), its paper is its summary and its module docstring, its relay merge rule is
its MERGE and its [privacy] dp levels its DP_LEVELS. What a client uploads is the server
handler's update_spec(), which needs a built handler: one is built for the embedded
default config (digits, cnn, 10 classes) with algorithm.name set, as `fedbus server`
builds it, so the shapes shown are that config's.
"""
from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

# Where uploads are measured: the embedded default config with only algorithm.name changed.
UPLOADS_ON = "the embedded default config (digits, cnn, 10 classes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="one algorithm: print every option (default, help, allowed values) "
                   "and its docstring's opening")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


# ---------------------------------------------------------------- reading the registry

def _registry():
    import fedbus.algorithms as registry

    return registry


def params_of(server_cls: type) -> dict[str, dict[str, Any]]:
    """The server class's PARAMS as plain records: {key: {default, help, choices, min,
    max}}. A PARAMS value is an Opt-like object or a bare default."""
    out = {}
    for key, opt in dict(getattr(server_cls, "PARAMS", {}) or {}).items():
        if hasattr(opt, "default"):
            choices = getattr(opt, "choices", None)
            out[key] = {"default": opt.default, "help": getattr(opt, "help", "") or "",
                        "choices": list(choices) if choices is not None else None,
                        "min": getattr(opt, "min", None), "max": getattr(opt, "max", None)}
        else:
            out[key] = {"default": opt, "help": "", "choices": None, "min": None, "max": None}
    return out


def param_lines(params: dict[str, dict[str, Any]], indent: str = "  ") -> list[str]:
    """One line per option, as `fedbus run --help-config` writes a [section]'s keys."""
    lines = []
    for key, p in params.items():
        allowed = []
        if p["choices"] is not None:
            allowed.append(f"one of {', '.join(map(str, p['choices']))}")
        if p["min"] is not None:
            allowed.append(f">= {p['min']}")
        if p["max"] is not None:
            allowed.append(f"<= {p['max']}")
        extra = f" ({'; '.join(allowed)})" if allowed else ""
        comment = f"  # {p['help']}{extra}" if p["help"] or extra else ""
        lines.append(f"{indent}{key} = {p['default']!r}{comment}")
    return lines


def summary_of(algo: Any) -> str:
    """The one-line description: the Algorithm's summary (its paper), else the first line
    of its module's (or server class's) docstring."""
    if getattr(algo, "summary", ""):
        return " ".join(algo.summary.split())
    doc = _doc(algo)
    return doc.splitlines()[0].strip() if doc else ""


def _doc(algo: Any) -> str:
    module = sys.modules.get(algo.server.__module__)
    return ((module.__doc__ if module is not None else None) or algo.server.__doc__ or "").strip()


def opening(algo: Any) -> str:
    """The module docstring's first paragraph; when that is only a title (one or two
    lines), the next paragraph too, which in every built-in module cites the paper."""
    paragraphs = [p.strip() for p in _doc(algo).split("\n\n") if p.strip()]
    if not paragraphs:
        return ""
    take = 2 if len(paragraphs[0].splitlines()) <= 2 and len(paragraphs) > 1 else 1
    return "\n\n".join(paragraphs[:take])


def merge_of(server_cls: type) -> str | None:
    """The name of the class's own merge rule (how relays pre-add its updates), or None."""
    try:
        rule = server_cls.merge_rule()
    except Exception:  # a plugin's class without the base's merge_rule
        rule = vars(server_cls).get("MERGE")
    if rule is None:
        return None
    return getattr(rule, "name", None) or type(rule).__name__


def dp_of(server_cls: type) -> list[str]:
    """The [privacy] dp levels the class admits, as the preflight reads them."""
    try:
        from fedbus.node.privacy.dp import dp_levels
    except ImportError:  # [privacy] extras' modules missing: the class's own declaration
        return list(vars(server_cls).get("DP_LEVELS", ()))
    return list(dp_levels(server_cls))


# ---------------------------------------------------------------- what travels

def _is_leaf(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)


def _shape(shape: tuple) -> str:
    return "x".join("?" if d is None else str(d) for d in shape)


def spec_json(spec: Any) -> Any:
    if _is_leaf(spec):
        return {"dtype": spec[0], "shape": list(spec[1])}
    if isinstance(spec, dict):
        return {k: spec_json(v) for k, v in spec.items()}
    return repr(spec)


def spec_text(spec: dict[str, Any], model_keys: set[str] | None = None) -> str:
    """One line: `protos float32[10x50], counts int64[10]`; a dict of tensors is named by
    how it relates to the client's model (every tensor of it, or some)."""
    if not spec:
        return "no arrays (an update carries none)"
    parts = []
    for key, v in spec.items():
        if _is_leaf(v):
            parts.append(f"{key} {v[0]}[{_shape(v[1])}]")
            continue
        if not isinstance(v, dict):
            parts.append(key)
            continue
        names = list(v)
        if model_keys and set(names) == model_keys:
            what = f"all {len(names)} tensors of a client network"
        elif model_keys and set(names) < model_keys:
            what = f"{len(names)} of a client network's {len(model_keys)} tensors"
        else:
            what = f"{len(names)} tensors"
        shown = ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}"
        nested = [n for n in names if isinstance(v[n], dict)]
        if nested:
            shown += f"; {len(nested)} as factors {', '.join(v[nested[0]])}"
        parts.append(f"{key} ({what}: {shown})")
    return ", ".join(parts)


def uploads(name: str) -> dict[str, Any]:
    """What a client of `name` uploads on the embedded default config: {"spec", "text"},
    or {"error"} when no handler could be built there (a plugin needing other settings)."""
    import logging
    import warnings

    from fedbus.node.config import load_config

    disabled = logging.root.manager.disable
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.disable(max(disabled, logging.WARNING))
            try:
                from fedbus.node.server import build_handler

                cfg = load_config(None, [f"algorithm.name={json.dumps(name)}"])
                handler = build_handler(cfg)
                spec = handler.update_spec()
                try:
                    model_keys = set(handler.ctx.make_model(0).state_dict())
                except Exception:
                    model_keys = None
            finally:
                logging.disable(disabled)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]}
    return {"spec": spec_json(spec), "text": spec_text(spec, model_keys)}


# ---------------------------------------------------------------- the command

def describe(name: str, *, full: bool, travels: bool = True) -> dict[str, Any]:
    """An algorithm's record. Raises KeyError (unknown name) or the plugin's own error."""
    algo = _registry().get_algorithm(name)
    params = params_of(algo.server)
    out: dict[str, Any] = {"name": name, "summary": summary_of(algo),
                           "module": algo.server.__module__,
                           "options": len(params), "merge": merge_of(algo.server),
                           "dp_levels": dp_of(algo.server)}
    if travels:
        out["uploads"] = uploads(name)
    if full:
        out["doc"] = opening(algo)
        out["params"] = params
    return out


def _uploads_line(rec: dict[str, Any]) -> str:
    up = rec.get("uploads", {})
    return up.get("text") or f"(not derived: {up.get('error', '?')})"


def main(args: argparse.Namespace) -> int:
    registry = _registry()
    if args.name is not None:
        try:
            rec = describe(args.name, full=True)
        except KeyError as err:
            print(f"fedbus algorithms: {err.args[0]}", file=sys.stderr)
            return 2
        except Exception as err:  # a plugin that does not load
            print(f"fedbus algorithms: {args.name}: {type(err).__name__}: {err}",
                  file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(rec, indent=2, default=repr))
            return 0
        print(f"{rec['name']}: {rec['summary']}\n")
        if rec["doc"]:
            print(rec["doc"] + "\n")
        print(f"module: {rec['module']}")
        print(f"uploads on {UPLOADS_ON}: {_uploads_line(rec)}")
        print(f"relay merge rule: {rec['merge'] or 'none (relays forward updates as they are)'}")
        print(f"[privacy] dp: {', '.join(rec['dp_levels']) or 'off only'}")
        print(f"\n[algorithm] options ({rec['options']}; set with --set algorithm.KEY=VALUE or "
              f"in CONFIG's [algorithm]):")
        print(f"  name = {rec['name']!r}")
        print("\n".join(param_lines(rec["params"])) or "  (no options)")
        return 0

    records = []
    for name in registry.available():
        try:
            records.append(describe(name, full=False))
        except Exception as err:  # a broken plugin does not hide the others
            records.append({"name": name, "error": f"{type(err).__name__}: {err}"})
    if args.json:
        print(json.dumps(records, indent=2, default=repr))
        return 0
    print(f"{len(records)} algorithms (algorithm.name = NAME; `fedbus algorithms NAME` for "
          f"every option). Uploads are measured on {UPLOADS_ON}.\n")
    width = max(len(r["name"]) for r in records) if records else 0
    for r in records:
        if "error" in r:
            print(f"{r['name']:<{width}}  cannot be loaded: {r['error']}\n")
            continue
        print(f"{r['name']:<{width}}  {r['summary']}")
        pad = " " * (width + 2)
        print(f"{pad}uploads: {_uploads_line(r)}")
        print(f"{pad}options: {r['options']}   relay merge: {r['merge'] or 'none'}   "
              f"dp: {', '.join(r['dp_levels']) or 'off only'}\n")
    return 0


# ---------------------------------------------------------------- fedbus run --help-config

class ChoiceError(Exception):
    """The config or --set words do not say a usable algorithm; the message is one line."""


def _override_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()  # a bare word such as fedtgp


def _schema_default() -> str:
    from fedbus.node import config

    return str(config.SCHEMA["algorithm"]["name"].default)


def chosen_algorithm(config: str | None, overrides: list[str]) -> tuple[str, str]:
    """(name, where it was chosen) as `fedbus run CONFIG --set ...` would choose it: the
    last --set algorithm.name, else CONFIG's [algorithm] name, else the default's."""
    for text in reversed(overrides):
        dotted, sep, raw = text.partition("=")
        if sep and dotted.strip() == "algorithm.name":
            return str(_override_value(raw)), "--set algorithm.name"
    if config is not None:
        path = Path(config)
        try:
            raw_cfg = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ChoiceError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ChoiceError(f"{path}: {err}") from None
        except tomllib.TOMLDecodeError as err:
            raise ChoiceError(f"{path}: not valid TOML: {err}") from None
        table = raw_cfg.get("algorithm", {})
        if isinstance(table, dict) and "name" in table:
            return str(table["name"]), f"{path}'s [algorithm] name"
        return _schema_default(), "the default algorithm"
    from importlib import resources

    embedded = tomllib.loads(resources.files("fedbus.launch").joinpath("default.toml")
                             .read_text())
    name = embedded.get("algorithm", {}).get("name")
    return (str(name), "the default algorithm") if name else (_schema_default(),
                                                                "the default algorithm")


def algorithm_block(name: str, source: str) -> list[str]:
    """The lines `fedbus run --help-config` adds under [algorithm]: which algorithm they
    are for and each of its parameters. Raises ChoiceError for an unknown name."""
    registry = _registry()
    try:
        algo = registry.get_algorithm(name)
    except KeyError as err:
        raise ChoiceError(f"algorithm.name = {name!r}: {err.args[0]}") from None
    except Exception as err:  # a plugin that does not load
        raise ChoiceError(f"algorithm.name = {name!r}: {type(err).__name__}: {err}") from None
    params = params_of(algo.server)
    head = (f"  # parameters of {name} ({source}): {summary_of(algo)}")
    hint = ("  # another algorithm's: --set algorithm.name=NAME --help-config; "
            "every algorithm: fedbus algorithms")
    body = param_lines(params) or [f"  # ({name} has no parameters)"]
    return [head, hint, *body]


def with_algorithm(described: str, block: list[str]) -> str:
    """describe_options()'s text with `block` at the end of its [algorithm] section."""
    lines = described.splitlines()
    try:
        start = lines.index("[algorithm]")
    except ValueError:
        return "\n".join([*lines, "[algorithm]", *block])
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")),
               len(lines))
    return "\n".join([*lines[:end], *block, *lines[end:]])


def help_config(args: argparse.Namespace) -> int:
    """`fedbus run [CONFIG] [--set ...] --help-config`: every [section] option, and the
    chosen algorithm's parameters under [algorithm]."""
    from fedbus.node.config import ConfigError, describe_options, load_config

    config, overrides = getattr(args, "config", None), list(getattr(args, "overrides", []) or [])
    try:
        name, source = chosen_algorithm(config, overrides)
        block = algorithm_block(name, source)
        resolved = load_config(config, overrides).to_dict()
    except (ChoiceError, ConfigError) as err:
        print(f"fedbus: config error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    where = config or "the embedded default federation (launch/default.toml)"
    print(f"# the values `fedbus run` uses with {where}"
          f"{' and --set' if overrides else ''}; `--print-config` prints them as TOML")
    print(with_algorithm(describe_options(resolved), block))
    return 0
