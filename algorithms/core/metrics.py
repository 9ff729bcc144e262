"""What every handler's evaluate() reports: accuracy and loss of a classifier head, or
pixel accuracy and mean IoU of a dense (segmentation) head, over a test split.

ClientHandler.evaluate (fedbus.algorithms.core.handlers) and every algorithm that scores
its own model call `head_metrics`; the prototype classifiers in
fedbus.algorithms.core.protos report "proto_acc"/"proto_miou" alongside.
"""
from __future__ import annotations

import numpy as np
import torch


def confusion_matrix(pred: torch.Tensor, labels: torch.Tensor,
                     num_classes: int) -> torch.Tensor:
    """[C, C] int64 counts, rows = truth, columns = prediction, over the labels in
    0..C-1 (ignored pixels, < 0 or >= C, count nowhere). Any shapes, pred like labels."""
    y = labels.reshape(-1)
    p = pred.reshape(-1).to(y.device)
    ok = (y >= 0) & (y < num_classes)
    idx = y[ok] * num_classes + p[ok].clamp(0, num_classes - 1)
    return torch.bincount(idx, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes)


def dense_scores(conf: torch.Tensor | np.ndarray) -> tuple[float, float]:
    """(pixel accuracy, mean IoU) of a confusion matrix. IoU_c = TP_c / (TP_c + FP_c +
    FN_c), averaged over the classes present in the ground truth or the prediction
    (TP + FP + FN > 0): the usual per-split mIoU (Pascal VOC's, background included);
    (nan, nan) without a valid pixel."""
    c = np.asarray(conf.cpu() if isinstance(conf, torch.Tensor) else conf, dtype=np.float64)
    total = c.sum()
    if total <= 0:
        return float("nan"), float("nan")
    tp = np.diag(c)
    union = c.sum(0) + c.sum(1) - tp
    present = union > 0
    return float(tp.sum() / total), float((tp[present] / union[present]).mean())


class HeadScores:
    """head_metrics' classification figures accumulated batch by batch on the logits'
    device: the cross-entropy sum (float64, each batch's float32 sum added in order, as
    a Python float sum of their .item() would) and the count of correct argmaxes. Only
    `result` reads them back, so a GPU is not synchronised once per batch."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | None = None
        self.correct: torch.Tensor | None = None
        self.count = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Score one batch: logits [B, C], labels [B]."""
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum").double()
        correct = (logits.argmax(1) == labels).sum()
        self.loss = loss if self.loss is None else self.loss + loss
        self.correct = correct if self.correct is None else self.correct + correct
        self.count += len(labels)

    def result(self) -> dict[str, float]:
        """{"acc", "loss" (mean cross-entropy), "num_test"}; nan without samples."""
        if self.count == 0:
            return {"acc": float("nan"), "loss": float("nan"), "num_test": 0}
        return {"acc": int(self.correct.item()) / self.count,
                "loss": float(self.loss.item()) / self.count, "num_test": self.count}


@torch.inference_mode()
def head_metrics(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 batch: int = 512) -> dict[str, float]:
    """The classifier head on (x, y): {"acc", "loss", "num_test"}. For segmentation
    masks y [N, H, W] (logits [N, C, H, W]): "acc" = pixel accuracy, "loss" = mean
    per-pixel cross-entropy, "miou" = mean IoU (dense_scores), all over the pixels with
    a valid label (ignored ones, -100, count nowhere); "num_test" = images. The model
    is left in train mode."""
    if y.dim() == 3:
        return _dense_head_metrics(model, x, y, min(batch, 64))
    scores = HeadScores()
    if len(y) == 0:
        return scores.result()
    model.eval()
    for i in range(0, len(y), batch):
        scores.add(model(x[i:i + batch]), y[i:i + batch])
    model.train()
    return scores.result()


def _dense_head_metrics(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                        batch: int) -> dict[str, float]:
    if len(y) == 0:
        return {"acc": float("nan"), "miou": float("nan"), "loss": float("nan"),
                "num_test": 0}
    model.eval()
    conf, loss, pixels = None, 0.0, 0
    for i in range(0, len(y), batch):
        logits = model(x[i:i + batch])
        yb = y[i:i + batch]
        num_classes = logits.shape[1]
        # ignore_index -100: the client's ignored pixels (and any label out of range)
        yb = torch.where((yb >= 0) & (yb < num_classes), yb, -100)
        loss += torch.nn.functional.cross_entropy(logits, yb, reduction="sum").item()
        pixels += (yb >= 0).sum().item()
        c = confusion_matrix(logits.argmax(1), yb, num_classes)
        conf = c if conf is None else conf + c
    model.train()
    acc, miou = dense_scores(conf)
    return {"acc": acc, "miou": miou, "loss": loss / pixels if pixels else float("nan"),
            "num_test": len(y)}
