"""Evaluation metrics of an HFModule over a whole validation (or test) set: each rank keeps its batches'
predictions and labels, the ranks that read different data gather them, and every rank computes the same
numbers from all of them (a per-rank mean of F1 is not the F1 of the set).

`compute_metrics(predictions, labels) -> dict` is Hugging Face Trainer's shape: predictions are the logits
of every labelled example (sequence classification) or token (token classification), [N, classes], and
for the generative tasks (causal LM, seq2seq) the predicted token ids [N]; labels are the ints [N]."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

MetricFn = Callable[[torch.Tensor, torch.Tensor], Mapping[str, Any]]


def _predicted(predictions: torch.Tensor) -> torch.Tensor:
    """Class ids: the argmax of logits, or the ids themselves."""
    return predictions.argmax(-1) if predictions.is_floating_point() else predictions


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """{"accuracy": the share of predictions equal to their label}."""
    if labels.numel() == 0:
        return {"accuracy": float("nan")}
    return {"accuracy": float((_predicted(predictions) == labels).double().mean())}


def f1(predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """{"f1": macro-averaged F1}: the mean over the classes seen in labels or predictions of each class's F1
    (scikit-learn's `f1_score(average="macro")`)."""
    predicted = _predicted(predictions)
    classes = torch.unique(torch.cat([labels, predicted]))
    scores = []
    for c in classes:
        tp = float(((predicted == c) & (labels == c)).sum())
        wrong = float(((predicted == c) != (labels == c)).sum())  # false positives + false negatives
        scores.append(2 * tp / (2 * tp + wrong))  # never 0/0: class c occurs in one of them
    return {"f1": sum(scores) / len(scores) if scores else float("nan")}


BUILT_IN: dict[str, MetricFn] = {"accuracy": accuracy, "f1": f1}


def resolve(metrics: str | MetricFn | Sequence[str | MetricFn] | None) -> list[MetricFn]:
    """The metric functions `metrics` names: built-in names ("accuracy", "f1"), callables, or a list of both."""
    if metrics is None:
        return []
    items = [metrics] if isinstance(metrics, str) or callable(metrics) else list(metrics)
    out = []
    for item in items:
        if callable(item):
            out.append(item)
        elif isinstance(item, str) and item in BUILT_IN:
            out.append(BUILT_IN[item])
        else:
            raise ValueError(
                f"metrics entry {item!r} is unknown; allowed: {', '.join(map(repr, BUILT_IN))} or a callable "
                "compute_metrics(predictions, labels) -> dict"
            )
    return out


class EvalCollector:
    """One evaluation's predictions and labels on this rank, and the metrics of all ranks' together."""

    def __init__(self, functions: list[MetricFn]) -> None:
        self.functions = functions
        self.reset()

    def reset(self) -> None:
        self._predictions: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def add(self, predictions: torch.Tensor, labels: torch.Tensor) -> None:
        """Keep one batch's predictions and labels (on the CPU: the set may not fit the accelerator)."""
        kept = predictions.detach().cpu()
        self._predictions.append(kept.float() if kept.is_floating_point() else kept)
        self._labels.append(labels.detach().cpu())

    def compute(self, gather: Callable[[Any], list[Any]]) -> dict[str, float]:
        """Every metric over the predictions of every rank `gather` (an all-gather of objects) reaches."""
        parts = gather((_cat(self._predictions), _cat(self._labels)))
        self.reset()
        kept = [(p, lab) for p, lab in parts if lab.numel()]
        if not kept:
            return {}
        predictions = torch.cat([p for p, _ in kept])
        labels = torch.cat([lab for _, lab in kept])
        out: dict[str, float] = {}
        for fn in self.functions:
            result = fn(predictions, labels)
            if not isinstance(result, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float, torch.Tensor)) for k, v in result.items()
            ):
                name = getattr(fn, "__name__", repr(fn))
                raise TypeError(
                    f"metric {name} returned {type(result).__name__} {result!r:.80}; allowed: a dict of "
                    "metric name -> number"
                )
            out.update({k: float(v) for k, v in result.items()})
        return out


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.long)
