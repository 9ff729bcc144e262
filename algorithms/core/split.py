"""The body/head split of a network's weights, for the algorithms that share one part
and keep the other (LG-FedAvg, FedPer, FedRep, FedGH).

Every fedbus network is features(x) -> h -> head(h) (fedbus.models.base.ProtoNet); its
`head_module` attribute names the sub-module the head applies ("fc" unless a network
says otherwise: "fc2" for FedProto's CNN, "classifier" for MP-FedCL's MLP). A weight
belongs to the head when its state-dict name starts with "<head_module>.", to the body
(the feature extractor) otherwise.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def head_prefix(model: torch.nn.Module) -> str:
    name = getattr(model, "head_module", "fc")
    if not isinstance(getattr(model, name, None), torch.nn.Module):
        raise ValueError(f"{type(model).__name__} has no head module {name!r}; set its "
                         f"head_module attribute to the sub-module head() applies")
    return name + "."


def head_names(model: torch.nn.Module) -> list[str]:
    """State-dict names of the head's weights (buffers included), in model order."""
    prefix = head_prefix(model)
    return [k for k in model.state_dict() if k.startswith(prefix)]


def body_names(model: torch.nn.Module) -> list[str]:
    """State-dict names of everything else: the feature extractor."""
    prefix = head_prefix(model)
    return [k for k in model.state_dict() if not k.startswith(prefix)]


def head_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    prefix = head_prefix(model)
    return [p for n, p in model.named_parameters() if n.startswith(prefix)]


def body_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    prefix = head_prefix(model)
    return [p for n, p in model.named_parameters() if not n.startswith(prefix)]


def subset(weights: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    return {k: weights[k] for k in names}
