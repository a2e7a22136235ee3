"""The fidelity gate's measurements: every backend against the torch fp32 reference, on a fixed corpus.

For each backend it scores the same texts the way a worker does (tokenized by the backend itself,
sorted, cut into padded passes by `worker.scorer` with the configured budgets, so most texts sit next
to a longer one and carry padding) and compares, against the reference's scores of the same texts
(`worker.gate.compare`, the one comparison the gate and the benchmarks use):

- the largest and the 99th-percentile absolute difference of any probability (`max_abs`, `p99_abs`);
- the fraction of texts whose decision at 0.5, or at any of `THRESHOLDS`, differs in any label
  (`flip_fraction`: the worst threshold's);
- per label, the Spearman rank correlation over the texts the reference scores >= `RANK_FLOOR` on that
  label (`min_spearman`: the worst label's).

Budgets (`FP32_BUDGET`, `REDUCED_BUDGET`; docs/backends.md gives the reasoning and measured figures):
a backend that misses its budget cannot be `auto`'s choice. The reference itself is checked too:
padded passes against one text per pass (no padding at all) on the first texts. The command that
runs it is `python -m worker.gate` (`worker.gate.cli`).

What a run costs (`run_gate`): the reference's scores are read from the export directory when they were
kept for this checkpoint and corpus (`worker.gate.reference`), candidates are timed before any is judged,
and only those that could still be chosen are judged, each judgment stopping once a miss is proven.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from worker.backends import registry
from worker.backends.base import FP32, Backend
from worker.backends.loader import load_backend, unavailable
from worker.gate.compare import THRESHOLD, THRESHOLDS, Budget, Comparison, compare
from worker.gate.probes import probe_texts
from worker.gate.record import GateRecord, Percent
from worker.gate.reference import ReferenceScores, read_reference, reference_key
from worker.onnx_export.artifacts import REFERENCE_FILE, ExportError, export_location
from worker.scorer import PASS_OVERHEAD_TOKENS, Scorer, planned
from worker.settings import WorkerSettings

FP32_BUDGET = Budget(max_abs=1e-4, p99_abs=1e-4, max_flip_fraction=0.005, min_spearman=0.999)
"""For backends that compute in fp32: only summation order may differ."""

REDUCED_BUDGET = Budget(max_abs=0.05, p99_abs=0.01, max_flip_fraction=0.005, min_spearman=0.999)
"""For int8 and bf16 backends: what a moderation user would notice. A decision (at 0.5 or at any
threshold) changes on at most 0.5 % of texts, 99 % of probabilities move by at most 0.01 and none by
more than 0.05, and the review order among texts that score at all (>= `RANK_FLOOR`) is kept."""

GATE_SEED = 4242
"""Seed of the gate corpus: fixed, and different from the benchmark corpus."""

DEFAULT_TEXTS = 1024
"""Texts in the gate corpus; at this size one flip is 0.1 %, so the 0.5 % budget allows five."""

REFERENCE_CHECK_TEXTS = 24
"""Texts the reference also scores one per pass, to prove its padded passes match unpadded ones."""

CANDIDATES = registry.candidates()
"""Backends gated by default, besides the reference."""

SPEED_TEXTS = 128
"""Texts of the corpus each backend is timed on, before any is judged for fidelity: the gate's cost on a
full-size model, where one pass over them takes tens of seconds, scales with it."""

SPEED_REPEATS = 5
"""At most this many timed passes over the speed sample, while they add up to under `SPEED_SECONDS`; the
fastest counts. The gate runs at low priority beside serving workers, so one pass can land in a burst
of their work: noise only ever adds time, and the fastest pass is the least disturbed."""

SPEED_SECONDS = 10.0
"""Timed passes go on (up to `SPEED_REPEATS`) while all of them together took less than this: small models
get several passes, a full-size model one."""

SPEED_BATCH = 8
"""Texts per timed batch: about what a worker process takes at once under load (9 at 32 clients on the
trained checkpoint, one at one client). Timed on the whole corpus at once instead, whose 1,024 texts sort
into full passes of near-equal lengths (a shape the fleet rarely has), the gate ranked backends in the
opposite order from the full stack (docs/history.md)."""

EDGE_TEXTS = ["", "ok", "You are an idiot!!!", "Ünïcödé ✓ 😀 — ﬁ", "word " * 800]
"""Texts a tokenizer or truncation mistake shows on: empty, tiny, punctuation, non-ASCII, > 512 tokens."""

NOT_JUDGED = "not judged"
"""How the error of a row that was timed but not judged for fidelity begins."""


def gate_texts(n: int = DEFAULT_TEXTS) -> list[str]:
    """The fixed gate corpus: the edge texts, then comment-like texts of mixed lengths, 70 % of them
    carrying a phrase of `worker.gate.probes` (many ambiguous, so near a threshold on a model trained
    on them, such as `tools.trained`'s)."""
    edge = EDGE_TEXTS[: max(0, n)]
    return edge + probe_texts(max(0, n - len(edge)), GATE_SEED)


@dataclass
class GateRow:
    backend: str
    precision: str
    texts: int
    max_abs: float
    p99_abs: float
    mean_abs: float
    flips: int
    flip_fraction: float
    min_spearman: float
    budget_max_abs: float
    budget_p99_abs: float
    budget_flip_fraction: float
    budget_min_spearman: float
    passed: bool
    texts_per_s: float
    load_seconds: float
    error: str | None = None
    judged: bool = True
    """False for a candidate timed but not judged for fidelity (`NOT_JUDGED`: slower than one that may be
    chosen); its fidelity figures are NaN."""
    stopped: str | None = None
    """Where a judgment stopped early, and on what proof of a miss; its figures cover `texts` texts."""


def budget_for(precision: str) -> Budget:
    return FP32_BUDGET if precision == FP32 else REDUCED_BUDGET


def precision_of(name: str) -> str:
    """A backend's precision class from its name, for rows of backends that could not load."""
    return registry.precision(name)


def score(backend: Backend, texts: Sequence[str], settings: WorkerSettings,
          on_pass: Callable[[list[int], list[list[float]]], None] | None = None) -> list[list[float]]:
    """Scores as lists in label order, the whole corpus sorted into the configured passes at once: the
    fullest passes a worker makes, where a scale shared by the texts of a pass (int8) errs most.
    `on_pass` hears each pass (`worker.scorer.Scorer.score`)."""
    results, _ = Scorer(backend, settings.pass_tokens, settings.pass_texts).score(texts, on_pass=on_pass)
    return [[r[label] for label in backend.labels] for r in results]


def speed(backend: Backend, texts: Sequence[str], settings: WorkerSettings) -> float:
    """Texts/s scoring the first `SPEED_TEXTS` texts as a worker under load does: `SPEED_BATCH` at a time,
    in corpus order (mixed lengths), planned with the backend's own cost of a pass (after a warm-up); the
    fastest of up to `SPEED_REPEATS` passes over them."""
    scorer = planned(backend, settings.pass_tokens, settings.pass_texts, settings.pass_overhead_tokens)
    sample = texts[:SPEED_TEXTS]
    batches = [sample[i:i + SPEED_BATCH] for i in range(0, len(sample), SPEED_BATCH)]
    scorer.score(batches[0])  # warm-up
    times: list[float] = []
    while len(times) < SPEED_REPEATS and sum(times) < SPEED_SECONDS:
        started = time.perf_counter()
        for batch in batches:
            scorer.score(batch)
        times.append(time.perf_counter() - started)
    return len(sample) / min(times)


def measure(backend: Backend, texts: Sequence[str], reference: Sequence[Sequence[float]],
            reference_labels: Sequence[str], settings: WorkerSettings) -> GateRow:
    """One backend's gate row against reference scores of the same texts."""
    budget = budget_for(backend.precision)
    if list(backend.labels) != list(reference_labels):
        return _failed(backend.name, backend.precision, len(texts), budget,
                       f"labels {backend.labels} differ from the reference's {list(reference_labels)}")
    scores = score(backend, texts, settings)
    return _row(backend.name, backend.precision, compare(reference, scores), budget, speed(backend, texts, settings),
                backend.load_seconds)


def _row(name: str, precision: str, c: Comparison, budget: Budget, rate: float, load_seconds: float) -> GateRow:
    return GateRow(name, precision, c.texts, c.max_abs, c.p99_abs, c.mean_abs, c.worst_flips, c.flip_fraction,
                   c.min_spearman, budget.max_abs, budget.p99_abs, budget.max_flip_fraction, budget.min_spearman,
                   c.within(budget), rate, load_seconds)


def _failed(name: str, precision: str, texts: int, budget: Budget, error: str) -> GateRow:
    return GateRow(name, precision, texts, math.inf, math.inf, math.inf, texts, 1.0, -1.0, budget.max_abs,
                   budget.p99_abs, budget.max_flip_fraction, budget.min_spearman, False, 0.0, 0.0, error)


def _not_judged(name: str, precision: str, rate: float, load_seconds: float, faster: str, faster_rate: float
                ) -> GateRow:
    """The row of a candidate not judged for fidelity: slower than one that may already be chosen."""
    budget = budget_for(precision)
    return GateRow(name, precision, 0, math.nan, math.nan, math.nan, 0, math.nan, math.nan, budget.max_abs,
                   budget.p99_abs, budget.max_flip_fraction, budget.min_spearman, False, rate, load_seconds,
                   f"{NOT_JUDGED}: slower than {faster} ({faster_rate:.1f} texts/s)", judged=False)


def reference_row(reference: Backend, scores: ReferenceScores, rate: float) -> GateRow:
    """The reference's own row: its padded passes against one text per pass (no padding)."""
    n = len(scores.alone)
    return _row(reference.name, reference.precision, compare(scores.alone, scores.scores[:n]), FP32_BUDGET, rate,
                reference.load_seconds)


def _quiet(_: str) -> None:
    pass


def _reference_path(settings: WorkerSettings) -> tuple[Path | None, str]:
    """(where this checkpoint's reference scores are kept, or None if nowhere yet; checkpoint sha256, or
    "" when the checkpoint is not on disk yet: the reference's load fetches it, and nothing is kept)."""
    try:
        directory, sha = export_location(settings)
    except ExportError:
        return None, ""
    return (directory / REFERENCE_FILE if directory.is_dir() else None), sha


def reference_scores(settings: WorkerSettings, texts: Sequence[str], progress: Callable[[str], None] = _quiet,
                     cache: bool = True, record: GateRecord | None = None
                     ) -> tuple[ReferenceScores, Backend | None]:
    """The reference's scores of `texts`: those kept in the export directory if they were made for this
    checkpoint, corpus, passes and versions; else scored now (with the percentage done) and kept there
    when the directory exists. Also the reference backend, when it was loaded to score them."""
    record = record if record is not None else GateRecord()
    path, sha = _reference_path(settings)
    seed = GATE_SEED if list(texts) == gate_texts(len(texts)) else None
    key = reference_key(sha, texts, seed, settings.pass_tokens, settings.pass_texts, PASS_OVERHEAD_TOKENS,
                        REFERENCE_CHECK_TEXTS)
    if cache and path is not None:
        kept = read_reference(path, key)
        if isinstance(kept, ReferenceScores):
            progress(f"reference torch: scores of {len(texts)} texts kept at {path} (made in {kept.seconds:.0f} s "
                     f"on {kept.cpu}); not scored again")
            record.reference = "cached"
            return kept, None
        if path.exists():
            progress(f"reference torch: ignoring kept scores: {kept}; scoring again")
    started = time.perf_counter()
    progress(f"reference torch on {len(texts)} texts")
    backend = load_backend("torch", settings)
    record.timed("torch", "load", started)
    started = time.perf_counter()
    meter = Percent(progress, "reference torch", len(texts))

    def counted(indices: list[int], _: list[list[float]]) -> None:
        record.reference_texts_scored += len(indices)
        meter.add(len(indices))

    scores = score(backend, texts, settings, counted)
    n = min(REFERENCE_CHECK_TEXTS, len(texts))
    alone = [backend.predict([seq])[0] for seq in backend.tokenize(texts[:n])]
    computed = ReferenceScores(key, list(backend.labels), scores, alone, time.perf_counter() - started)
    record.timed("torch", "reference scores", started)
    record.reference = "computed"
    if not cache:
        record.stored = "not kept (reference cache off)"
    elif path is None:
        record.stored = "not kept: no export directory for this checkpoint yet (`python -m worker.export` makes one)"
    else:
        try:
            record.stored = str(computed.write(path))
        except OSError as exc:
            record.stored = f"not kept: {exc}"
    progress(f"reference torch: scored in {computed.seconds:.0f} s; {record.stored}")
    return computed, backend


def run_gate(settings: WorkerSettings, backends: Sequence[str] = CANDIDATES,
             texts: Sequence[str] | None = None, progress: Callable[[str], None] = _quiet, *,
             full: bool = False, judge: Sequence[str] = (), cache: bool = True,
             record: GateRecord | None = None) -> list[GateRow]:
    """The gate table: the reference's row first, then one row per backend, in `backends`' order (a
    backend that cannot load on this machine gets a failed row saying why); `progress` hears each step.

    Speed first: every candidate is timed, then judged for fidelity fastest first, and only while it
    could still be chosen: one that is not faster than the reference, or than a candidate that passed,
    gets a row `NOT_JUDGED` (those in `judge` are judged anyway), and a judgment stops at the first
    pass that proves a miss (a probability off by more than the budget's maximum, or more flips than it
    allows). `choose` (`worker.gate.cli`) picks what the full judgment would. `full`: judge every
    candidate on every text (the table docs/backends.md shows). `cache`: read and keep the reference's
    scores (`reference_scores`); its speed is timed here either way."""
    began, began_cpu = time.perf_counter(), time.process_time()
    record = record if record is not None else GateRecord()
    texts = list(gate_texts() if texts is None else texts)
    kept, reference = reference_scores(settings, texts, progress, cache, record)
    if reference is None:
        started = time.perf_counter()
        reference = load_backend("torch", settings)
        record.timed("torch", "load", started)
    started = time.perf_counter()
    rate = speed(reference, texts, settings)
    record.timed("torch", "speed", started)
    rows: dict[str, GateRow] = {"torch": reference_row(reference, kept, rate)}
    progress(f"reference torch: {rate:.1f} texts/s, {'pass' if rows['torch'].passed else 'FAIL'} "
             f"(padded against unpadded, max abs {rows['torch'].max_abs:.2e})")
    ref_rate = rate
    del reference
    gc.collect()
    timed: list[tuple[float, str, float]] = []
    for k, name in enumerate(backends, 1):
        precision = precision_of(name)
        reason = unavailable(name)
        if reason is not None:
            rows[name] = _failed(name, precision, len(texts), budget_for(precision), f"cannot run here: {reason}")
            progress(f"[{k}/{len(backends)}] {name}: cannot run here: {reason}")
            continue
        started = time.perf_counter()
        try:
            backend = load_backend(name, settings)
        except Exception as exc:
            rows[name] = _failed(name, precision, len(texts), budget_for(precision), f"cannot load: {exc}")
            progress(f"[{k}/{len(backends)}] {name}: cannot load: {exc}")
            continue
        record.timed(name, "load", started)
        if list(backend.labels) != kept.labels:
            rows[name] = _failed(name, backend.precision, len(texts), budget_for(backend.precision),
                                 f"labels {backend.labels} differ from the reference's {kept.labels}")
            progress(f"[{k}/{len(backends)}] {name}: {rows[name].error}")
            continue
        started = time.perf_counter()
        rate = speed(backend, texts, settings)
        record.timed(name, "speed", started)
        progress(f"[{k}/{len(backends)}] {name}: {rate:.1f} texts/s ({rate / ref_rate:.2f}x torch)")
        if full:
            rows[name] = _judge(backend, texts, kept, settings, rate, backend.load_seconds, progress, record, False)
        else:
            timed.append((rate, name, backend.load_seconds))
        del backend
        gc.collect()
    best, best_rate = ("torch", ref_rate) if rows["torch"].passed else ("", 0.0)
    for rate, name, load_seconds in sorted(timed, reverse=True):
        if rate <= best_rate and name not in judge:
            rows[name] = _not_judged(name, precision_of(name), rate, load_seconds, best, best_rate)
            progress(f"{name}: {rows[name].error}")
            continue
        started = time.perf_counter()
        try:
            backend = load_backend(name, settings)
        except Exception as exc:
            rows[name] = _failed(name, precision_of(name), len(texts), budget_for(precision_of(name)),
                                 f"cannot load: {exc}")
            continue
        record.timed(name, "load", started)
        rows[name] = _judge(backend, texts, kept, settings, rate, load_seconds, progress, record, True)
        if rows[name].passed and rate > best_rate:
            best, best_rate = name, rate
        del backend
        gc.collect()
    record.seconds = time.perf_counter() - began
    record.cpu_seconds = time.process_time() - began_cpu
    return [rows["torch"], *(rows[name] for name in backends)]


class _Miss(Exception):
    """Raised from a pass of a judgment once the candidate can no longer be within its budget."""


def _judge(backend: Backend, texts: Sequence[str], kept: ReferenceScores, settings: WorkerSettings, rate: float,
           load_seconds: float, progress: Callable[[str], None], record: GateRecord, stop_early: bool) -> GateRow:
    """A candidate's fidelity row against the reference's scores, the percentage done reported as it
    scores; with `stop_early`, it stops at the pass that proves a miss (the row then holds the texts
    compared so far and says where it stopped)."""
    budget = budget_for(backend.precision)
    reference = kept.scores
    cuts = sorted({THRESHOLD, *THRESHOLDS})
    got: dict[int, list[float]] = {}
    flips = dict.fromkeys(cuts, 0)
    worst = [0.0]
    meter = Percent(progress, f"{backend.name} fidelity", len(texts))

    def check(indices: list[int], rows: list[list[float]]) -> None:
        for i, row in zip(indices, rows, strict=True):
            got[i] = list(row)
            ref = reference[i]
            worst[0] = max(worst[0], *(abs(r - c) if math.isfinite(c) else math.inf for r, c in zip(ref, row,
                                                                                                 strict=True)))
            for cut in cuts:
                flips[cut] += any((r >= cut) != (c >= cut) for r, c in zip(ref, row, strict=True))
        meter.add(len(indices))
        if not stop_early:
            return
        if not worst[0] <= budget.max_abs:
            raise _Miss(f"max abs {worst[0]:.2e} > {budget.max_abs:g}")
        if max(flips.values()) / len(texts) > budget.max_flip_fraction:
            raise _Miss(f"{max(flips.values())} flips > {budget.max_flip_fraction:.1%} of {len(texts)}")

    started = time.perf_counter()
    progress(f"{backend.name}: judging fidelity on {len(texts)} texts")
    stopped = None
    try:
        score(backend, texts, settings, check)
    except _Miss as miss:
        stopped = f"stopped after {len(got)} of {len(texts)} texts: {miss}"
    record.timed(backend.name, "fidelity", started)
    order = sorted(got)
    row = _row(backend.name, backend.precision, compare([reference[i] for i in order], [got[i] for i in order]),
               budget, rate, load_seconds)
    if stopped is not None:
        row.passed, row.stopped = False, stopped
    progress(f"{backend.name}: {'pass' if row.passed else 'FAIL'} (max abs {row.max_abs:.2e}"
             f"{'; ' + stopped if stopped else ''})")
    return row
