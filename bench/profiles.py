"""What one benchmark run measures per model: client counts, open-loop loads, windows, corpus and ceiling
sizes (`python -m bench.run --models kind:profile` picks one)."""

from __future__ import annotations

from dataclasses import dataclass

from bench.ceiling import PASS_TEXTS_SWEEP


@dataclass(frozen=True)
class Profile:
    """How much to measure for one model."""

    clients: tuple[int, ...]
    """Closed-loop client counts; the best throughput among them is the system's capacity."""
    open_loads: tuple[float, ...]
    """Open-loop arrival rates as fractions of the capacity measured in the same round."""
    windows: int
    """Measurement windows per point (the repeats each figure's median and range come from)."""
    window: float
    """Seconds per window (a closed-loop window stretches to the warm-up's median latency)."""
    warmup: float
    """Least seconds of load before the first window."""
    corpus: int
    """Distinct texts the load cycles through."""
    ceiling_per_process: int
    """Texts each ceiling process scores per configuration."""
    ceiling_reference: int
    """Texts each ceiling process scores one at a time with plain `Detoxify.predict`."""
    ceiling_repeats: int
    """Runs of the best ceiling configuration."""
    ceiling_sweep: tuple[int, ...] = PASS_TEXTS_SWEEP
    """Texts per forward pass the ceiling tries."""
    toxfleet_modes: tuple[str, ...] = ("compat", "jobs")
    """toxfleet's endpoints measured in the closed loop."""
    open_modes: tuple[str, ...] = ("baseline", "jobs")
    """Modes also measured in the open loop."""
    open_deadline: float = 60.0
    """Seconds an open-loop request may take before it counts as a timeout."""
    targets: tuple[tuple[str, float | None], ...] = ()
    """Targets of this profile's report in place of `bench.points.TARGETS`' (same names; a name with
    `/<mode>` applies to that toxfleet mode only; None: reported, not judged)."""


PROFILES: dict[str, Profile] = {
    "full": Profile(clients=(1, 10, 100), open_loads=(0.5, 1.0, 2.0), windows=3, window=8.0, warmup=3.0,
                    corpus=3000, ceiling_per_process=48, ceiling_reference=12, ceiling_repeats=3),
    # For the second architecture: the single-client and saturation points, toxfleet's own API only.
    "reduced": Profile(clients=(1, 100), open_loads=(), windows=2, window=8.0, warmup=3.0, corpus=3000,
                       ceiling_per_process=48, ceiling_reference=12, ceiling_repeats=2, toxfleet_modes=("jobs",)),
    # What a user gets on a trained checkpoint: toxfleet runs the backend `auto` picks, 1 and 32 clients.
    "headline": Profile(clients=(1, 32), open_loads=(), windows=2, window=8.0, warmup=3.0, corpus=3000,
                        ceiling_per_process=48, ceiling_reference=12, ceiling_repeats=2, toxfleet_modes=("jobs",)),
    # The serving path alone (issue 11): the tiny checkpoint, where inference is nearly free, 1 and 32 clients.
    # Issue 11's targets: submit-and-poll >= 0.5x and GET /toxicity >= 0.8x the existing design's texts/s,
    # the 1-client p50 within +30 ms; batching cannot beat a tiny model's own cost, so the rest is reported.
    "serving": Profile(clients=(1, 32), open_loads=(), windows=3, window=8.0, warmup=3.0, corpus=3000,
                       ceiling_per_process=48, ceiling_reference=12, ceiling_repeats=1,
                       targets=(("throughput_vs_baseline/jobs", 0.5), ("throughput_vs_baseline/compat", 0.8),
                                ("throughput_vs_ceiling", None), ("p99_vs_baseline", None))),
    "quick": Profile(clients=(1, 20), open_loads=(2.0,), windows=1, window=3.0, warmup=1.0, corpus=500,
                     ceiling_per_process=32, ceiling_reference=16, ceiling_repeats=1, ceiling_sweep=(1, 8),
                     open_deadline=20.0),
}

DEFAULT_MODELS = {"full": "unbiased-small:full,original:reduced,trained:headline:auto,tiny:serving",
                  "quick": "tiny:quick"}
"""Per run: comma list of kind[:profile[:backend]]; a model's backend overrides `--backend` for it."""


def model_specs(spec: str, profile: str, backend: str) -> list[tuple[str, str, str]]:
    """(kind, profile, backend) per item of a `kind[:profile[:backend]]` comma list; the run's profile
    and `--backend` fill what an item leaves out."""
    out = []
    for item in spec.split(","):
        kind, _, rest = item.strip().partition(":")
        profile_name, _, model_backend = rest.partition(":")
        if profile_name and profile_name not in PROFILES:
            raise SystemExit(f"bench: unknown profile {profile_name!r} in {item!r}; known: {', '.join(PROFILES)}")
        out.append((kind, profile_name or profile, model_backend or backend))
    return out
