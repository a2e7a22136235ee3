"""Flags from thresholds: configured defaults, per-request overrides, validation."""

from __future__ import annotations

import pytest

from toxfleet.thresholds import DEFAULT_THRESHOLD, Thresholds

SCORES = {"toxicity": 0.7, "insult": 0.5, "threat": 0.2}


def test_default_is_half_and_inclusive() -> None:
    """With no configuration a label is flagged at 0.5 or above, and flagged is any label."""
    flags = Thresholds().flags(SCORES)
    assert DEFAULT_THRESHOLD == 0.5
    assert flags == {"flagged": True, "labels": {"toxicity": True, "insult": True, "threat": False}}
    assert Thresholds().flags({"toxicity": 0.1})["flagged"] is False


def test_request_number_replaces_every_label() -> None:
    """A single number in a request applies to every label, replacing configured per-label values."""
    configured = Thresholds(0.5, {"threat": 0.1})
    flags = configured.override(0.9).flags(SCORES)
    assert flags == {"flagged": False, "labels": {"toxicity": False, "insult": False, "threat": False}}


def test_request_mapping_overrides_some_labels() -> None:
    """A mapping in a request overrides only the labels it names; the others keep the configured ones."""
    configured = Thresholds(0.6, {"threat": 0.1})
    t = configured.override({"toxicity": 0.8})
    assert (t.of("toxicity"), t.of("threat"), t.of("insult")) == (0.8, 0.1, 0.6)
    assert t.flags(SCORES)["labels"] == {"toxicity": False, "insult": False, "threat": True}


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), {"toxic": 0.5}, {"insult": 2}])
def test_invalid_thresholds_are_refused(bad: object) -> None:
    """Thresholds outside [0, 1] or naming an unknown label raise ValueError."""
    with pytest.raises(ValueError):
        Thresholds().override(bad)  # type: ignore[arg-type]


def test_json_round_trip() -> None:
    """What a job manifest stores reads back to the same thresholds."""
    t = Thresholds(0.3, {"threat": 0.2})
    assert Thresholds.from_json(t.to_json()) == t
