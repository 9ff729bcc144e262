"""Optional ImageNet weights, from local files only: fedbus never downloads.

Where torchvision publishes ImageNet weights for an architecture (resnet18,
resnet34, mobilenetv2), ``build_model(..., pretrained=True)`` copies every
tensor of torchvision's checkpoint whose name and shape match the fedbus
network. The checkpoint is looked for, in this order, in

    $FEDBUS_WEIGHTS_DIR, then torch's hub cache ($TORCH_HOME/hub/checkpoints,
    ~/.cache/torch/hub/checkpoints by default: where torchvision itself saves them)

under torchvision's file names (``resnet18-f37072fd.pth``, ...; any
``resnet18-*.pth`` is accepted). To get one, on a machine with internet:
``python -c "import torchvision; torchvision.models.resnet18(weights='IMAGENET1K_V1')"``
and copy the file over. Tensors that do not fit (the stem of a 1-channel or
small-input network, the 1000-class classifier) keep their fresh values; the
model's ``pretrained_info`` lists what was loaded and what was skipped.
Loading needs torch only (``torch.load(weights_only=True)``), not torchvision.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

# fedbus arch -> (torchvision file-name prefix, the IMAGENET1K_V1 file, key renames)
WEIGHTS: dict[str, tuple[str, str, tuple[tuple[str, str], ...]]] = {
    "resnet18": ("resnet18-", "resnet18-f37072fd.pth", ()),
    "resnet34": ("resnet34-", "resnet34-b627a593.pth", ()),
    "mobilenetv2": ("mobilenet_v2-", "mobilenet_v2-b0353104.pth", (("features.", "body."),)),
}


class PretrainedUnavailable(RuntimeError):
    """Pretrained weights were asked for but cannot be used."""


def weight_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("FEDBUS_WEIGHTS_DIR"):
        dirs.append(Path(os.path.expanduser(os.environ["FEDBUS_WEIGHTS_DIR"])))
    dirs.append(Path(torch.hub.get_dir()) / "checkpoints")
    return dirs


def find_weights(arch: str) -> Path | None:
    prefix, preferred, _ = WEIGHTS[arch]
    for d in weight_dirs():
        if (d / preferred).is_file():
            return d / preferred
        found = sorted(d.glob(f"{prefix}*.pth")) if d.is_dir() else []
        if found:
            return found[0]
    return None


def load_pretrained(model: torch.nn.Module, arch: str) -> dict:
    """Copy matching ImageNet tensors into ``model``; returns {"file", "loaded", "skipped"}."""
    base = arch.split(":", 1)[0]
    if base not in WEIGHTS:
        raise PretrainedUnavailable(
            f"no ImageNet weights exist for arch {arch!r}; pretrained weights are available "
            f"for {', '.join(WEIGHTS)} (set model.pretrained = false)")
    path = find_weights(base)
    if path is None:
        where = " or ".join(str(d) for d in weight_dirs())
        raise PretrainedUnavailable(
            f"model.pretrained = true but no ImageNet checkpoint for {arch} was found in "
            f"{where} (expected a file like {WEIGHTS[base][1]}). fedbus never downloads "
            f"weights: fetch it where there is internet with torchvision and copy it there, "
            f"or set FEDBUS_WEIGHTS_DIR")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    own = model.state_dict()
    loaded, skipped = [], []
    with torch.no_grad():
        for key, tensor in state.items():
            name = key
            for old, new in WEIGHTS[base][2]:
                if name.startswith(old):
                    name = new + name[len(old):]
            if name in own and isinstance(tensor, torch.Tensor) and own[name].shape == tensor.shape:
                own[name].copy_(tensor)
                loaded.append(name)
            else:
                skipped.append(key)
    if not loaded:
        raise PretrainedUnavailable(f"{path}: no tensor matches the {arch} network by name and "
                                    f"shape; is it a torchvision {base} checkpoint?")
    return {"file": str(path), "loaded": loaded, "skipped": skipped}
