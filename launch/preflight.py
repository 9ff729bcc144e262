"""Preflight: check a run's inputs before any process starts.

A bad dataset, partition file or model name used to surface as a traceback in
the server's log after the broker and nodes were up. ``check_inputs(cfg)``
finds it first, in the launcher, and raises ``PreflightError`` with one line
that names the config key and the problem. What it checks:

- model.arch and every name in model.group are known architectures;
- data.dataset loads: the npz file exists and holds matching ``x`` and ``y``;
  an online dataset (mnist, cifar10, ...) is here, or the loader's own message
  says why not and names ``npz:PATH`` (torchvision missing, offline);
- data.partition builds for federation.clients: a ``file:`` partition is
  readable JSON of the right shape, its indices in range, no index given to
  two clients, and it holds as many clients as the federation;
- log.tensorboard: TensorBoard is installed when asked for;
- [privacy]: secure aggregation and DP are refused, with one line saying why, for an
  algorithm or mode they cannot serve (fedbus.node.privacy.secure_round.privacy_refusal);
- log.ffd_reference: a run directory whose checkpoint holds a global model of this
  run's architecture, and an algorithm with one global model (fedbus.analysis.ffd);
- the networks build on that data (conv nets need images; a weight-averaging
  algorithm needs one architecture; a group shares one feature dim).

Once all pass, each of the config's notes (``Config.notes``: keys the partition does not
read, a path found only from the working directory) is a ``ConfigWarning``.

It checks by doing: the real loader, partitioner and model builder run here,
so the check and the run cannot disagree. Dataset and partition are cached per
process (fedbus.node.data, fedbus.node.setup), so a server forked from the
launcher inherits them instead of loading again.
"""
from __future__ import annotations

import warnings

from fedbus.node.config import Config, ConfigError, ConfigWarning

#: what the real loaders raise for bad input (DatasetUnavailable and
#: PretrainedUnavailable are RuntimeErrors; PartitionError and json errors ValueErrors)
_INPUT_ERRORS = (ValueError, TypeError, OSError, RuntimeError, ImportError)


class PreflightError(ConfigError):
    """A run input that cannot be used; the message is one line naming the key."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def check_inputs(cfg: Config) -> None:
    """Raise PreflightError if the model names, dataset or partition of ``cfg`` are unusable."""
    from fedbus.models import parse_arch
    from fedbus.node.data.federated import data_config, dataset_from_config
    from fedbus.node.setup import check_models, federated_data

    model, data = cfg.model, cfg.data
    names = [("model.arch", model.arch)]
    names += [(f"model.group[{i}]", a) for i, a in enumerate(model.group)]
    for key, name in names:
        try:
            parse_arch(name)
        except _INPUT_ERRORS as err:
            raise PreflightError(f"{key} = {name!r}: {err}") from None

    try:
        dataset_from_config(data_config(data), cfg.federation.seed)
    except _INPUT_ERRORS as err:
        raise PreflightError(f"data.dataset = {data.dataset!r}{cfg.origin('data.dataset')}: "
                             f"{err}") from None

    try:
        federated_data(cfg)
    except _INPUT_ERRORS as err:
        raise PreflightError(f"data.partition = {data.partition!r}"
                             f"{cfg.origin('data.partition')}: {err}") from None

    if cfg.log.tensorboard:
        from fedbus.record import MissingExtra
        from fedbus.record.tensorboard import require

        try:
            require()
        except MissingExtra as err:  # names the pip command
            raise PreflightError(str(err)) from None

    from fedbus.algorithms import get_algorithm

    try:
        server = get_algorithm(cfg.algorithm.name).server
        check_models(cfg, server.needs_same_model, server.needs_same_head)
    except ConfigError as err:  # names its key already
        raise PreflightError(str(err)) from None
    except _INPUT_ERRORS as err:
        key, value = ("model.group", model.group) if model.group else ("model.arch", model.arch)
        raise PreflightError(f"{key} = {value!r}: {err}") from None

    from fedbus.node.privacy.secure_round import privacy_refusal

    reason = privacy_refusal(cfg)
    if reason is not None:
        raise PreflightError(reason)

    if cfg.log.ffd_reference:
        from fedbus.analysis.ffd import check_reference

        try:
            check_reference(cfg)
        except ConfigError as err:  # names log.ffd_reference already
            raise PreflightError(str(err)) from None

    # what the config holds but likely does not mean, said once every input has passed, so
    # that a bad input's error stays the one line it is
    for note in getattr(cfg, "notes", ()):
        warnings.warn(note, ConfigWarning, stacklevel=2)
