"""Thresholds turn probabilities into moderation decisions: per-label booleans and `flagged`.

A label is flagged when its probability is at least its threshold; a text is `flagged` when any of
its labels is. Thresholds come from the deployment (`TOXFLEET_THRESHOLD`, one value for every label,
0.5 unless set; `TOXFLEET_THRESHOLDS`, per-label overrides) and may be overridden per request,
either with one number for every label or with `{label: threshold}`. Pure logic, shared by the API
and the CLI's local mode, so both decide the same way. Stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from toxfleet.contract import LABELS

DEFAULT_THRESHOLD = 0.5
"""Threshold of every label unless configured or requested otherwise (a probability: 0.5 flags
what the model thinks more likely toxic than not; raise it to flag less)."""


def check_threshold(value: float, where: str) -> float:
    """`value` as a float in [0, 1], or ValueError naming `where`."""
    value = float(value)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{where}: a threshold is a probability in [0, 1], got {value}")
    return value


def check_labels(per_label: Mapping[str, float], where: str) -> dict[str, float]:
    """Per-label thresholds with known labels and values in [0, 1], or ValueError."""
    unknown = sorted(set(per_label) - set(LABELS))
    if unknown:
        raise ValueError(f"{where}: unknown label(s) {unknown}; labels are {list(LABELS)}")
    return {label: check_threshold(v, f"{where}[{label!r}]") for label, v in per_label.items()}


@dataclass(frozen=True)
class Thresholds:
    """One threshold per label: `labels[label]` where given, else `default`."""

    default: float = DEFAULT_THRESHOLD
    labels: dict[str, float] = field(default_factory=dict)

    def of(self, label: str) -> float:
        return self.labels.get(label, self.default)

    def override(self, request: float | Mapping[str, float] | None) -> Thresholds:
        """These thresholds with a request's: a number replaces every label's, a mapping some labels'."""
        if request is None:
            return self
        if isinstance(request, Mapping):
            return Thresholds(self.default, {**self.labels, **check_labels(request, "thresholds")})
        return Thresholds(check_threshold(request, "thresholds"), {})

    def flags(self, scores: Mapping[str, float]) -> dict[str, Any]:
        """`{"flagged": bool, "labels": {label: bool}}` for one text's scores."""
        labels = {label: score >= self.of(label) for label, score in scores.items()}
        return {"flagged": any(labels.values()), "labels": labels}

    def to_json(self) -> dict[str, Any]:
        return {"default": self.default, "labels": dict(self.labels)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Thresholds:
        return cls(float(data["default"]), {k: float(v) for k, v in data.get("labels", {}).items()})
