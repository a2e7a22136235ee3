"""Render benchmark results (the JSON `bench.run` writes) as a markdown report and PNG plots.

    python -m bench.report docs/benchmarks/results.json [--report docs/benchmarks.md]

Everything printed is computed from the JSON: medians of the measurement windows with their
min-max range, ratios of figures from the same run, and the issue's targets checked against them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from bench.plots import plots
from bench.points import fmt_num, normalise, windows
from bench.sections import (
    ceiling_section,
    closed_section,
    cpu_per_job_section,
    open_section,
    ratio_section,
    targets_section,
    tokens_section,
)
from bench.stats import Spread

DISTURBED_CPU = 0.2
"""Cores used by other programs (median over windows) above which the report says the run was disturbed."""

NOTES = "notes.md"
"""Hand-written reading of the figures (and tables from other benchmarks), kept beside the plots and
placed after the header on every re-render, so regenerating the report does not erase it."""


def render(results: dict[str, Any], md: Path, plot_dir: Path, results_path: str = "<results.json>") -> None:
    meta = results["meta"]
    cpu = meta["cpu"]
    peak = float(cpu["gflops"])
    quick = meta["profile"] == "quick"
    regenerate = "make bench-quick" if quick else "make bench"
    lines = [
        "# Benchmarks" + (" (quick smoke run: tiny model, numbers mean nothing)" if quick else ""),
        "",
        *_disturbance(results),
        f"Regenerate with `{regenerate}` (= `{meta['command']}`; "
        f"took {meta['seconds'] / 60:.1f} min). Re-render from the raw results with "
        f"`python -m bench.report {results_path}`.",
        "",
        f"Measured {meta['started']} at commit `{meta['commit']}` on {cpu['model']}, {meta['cores']} cores "
        f"used by each system; load average {_load(meta['loadavg_start'])} at start, "
        f"{_load(meta.get('loadavg_end', [math.nan] * 3))} at end. Python {meta['python']}, "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + f", {meta['redis_server']}.",
        "",
        f"CPU peak (fp32): **{peak:.0f} GFLOP/s** = {cpu['assumptions']}.",
        "",
        "Weights are random (synthetic checkpoints with the real architectures, `python -m tools.synthetic`): "
        "compute is real, scores are meaningless; except `trained`'s, real all-MiniLM-L6-v2 weights fine-tuned "
        "offline (`python -m tools.trained`), on which the fidelity gate judges the reduced backends. "
        "The load generator runs on the same cores as the system "
        "under test (its CPU is in the raw results); \"other CPU\" is what the rest of the machine used "
        "meanwhile: well above 0 means a neighbour disturbed the run.",
        "",
    ]
    notes = plot_dir / NOTES
    if not quick and notes.is_file():
        lines += [notes.read_text().rstrip(), ""]
    for name, model in results["models"].items():
        normalised = normalise(model)
        files = plots(name, model, plot_dir)
        prof = model["profile"]
        arch = model["ceiling"]["architecture"]
        lines += [
            f"## {name}",
            "",
            f"Checkpoint `{Path(model['checkpoint']).parent.name}`: {arch['layers']} layers × {arch['hidden']} hidden, "
            f"{model['ceiling']['flops_per_token'] / 1e6:.3g} MFLOP per token (matmuls). "
            + _backend_sentence(model.get("backend"))
            + "Each figure is the median of "
            f"{prof['windows']} windows × {meta['rounds']} round(s) with its min–max range; a window is "
            f"{prof['window']:.0f} s or longer. "
            + (f"Throughput is **token-normalised**: tokens answered per second ÷ the corpus's mean of "
               f"{model['tokens']['mean']:.1f} tokens per text, so that a window (or the ceiling's sample) "
               "that happened to hold shorter texts does not count as faster; texts/s as counted is in the "
               "tables beside it." if normalised else
               "Throughput is texts/s as counted (these results predate token counts)."),
            "",
            "### Targets",
            "",
            targets_section(name, model, peak),
            "",
            "### Corpus: token lengths",
            "",
            f"{prof['corpus']} seeded synthetic comments (`fleet.corpus.CommentCorpus`, seed {meta['seed']}: "
            "log-normal word counts, median ≈ 36, mean ≈ 65 words), tokenized with the checkpoint's tokenizer:",
            "",
            tokens_section(model),
            "",
        ]
        if "tokens" in files:
            lines += [f"![token lengths]({_rel(files['tokens'], md)})", ""]
        lines += [
            f"### Raw model ceiling ({model['ceiling']['processes']} processes × 1 thread, no server)",
            "",
            f"Each process sorts its own {model['ceiling'].get('pool_per_process', '?')} texts by token length and "
            "plans the passes over all of them (the best case for padding), then `worker.scorer.Scorer` scores a "
            f"systematic sample of those passes, about {model['ceiling']['texts_per_process']} texts spread over "
            "the whole length range (tokenizing included); wall time from the first start to the last finish. "
            "The reference row scores texts one at a time in arrival order. Useful FLOPs count each text's own "
            "tokens; executed FLOPs include padding.",
            "",
            ceiling_section(model, peak),
            "",
            "### Closed loop",
            "",
            closed_section(model),
            "",
            "Same run, toxfleet ÷ baseline (ratio of medians; range from the extremes):",
            "",
            ratio_section(model),
            "",
            "CPU per request of each process (closed loop; one-text jobs, so per job): cores used ÷ texts "
            "answered per second, median over windows (range). The baseline is its Gunicorn tree; toxfleet's "
            "are the API, the Celery worker's main process, its pool processes and Redis "
            "(`make bench-cpu` adds Flower and Redis commands per job):",
            "",
            cpu_per_job_section(model),
            "",
            f"![throughput and p99 vs clients]({_rel(files['scaling'], md)})",
            "",
        ]
        if prof["open_loads"]:
            lines += [
                "### Open loop (Poisson arrivals at a fraction of each system's own capacity)",
                "",
                "Capacity is the system's best closed-loop throughput in the same round. Latency "
                f"percentiles cover answered requests and timeouts (> {prof['open_deadline']:.0f} s) and group "
                "requests by the window they were *issued* in; texts/s counts answers that *arrived* in a window. "
                "A queue that keeps growing shows as requests outstanding (sent, not yet answered) rising from "
                "one window edge to the next, and p99 with it.",
                "",
                open_section(model),
                "",
            ]
        lines += [f"![latency CDF]({_rel(files['cdf'], md)})", ""]
    lines += [
        "## How it is measured",
        "",
        "- **baseline**: `bench/baseline_app.py`, the existing service's design exactly: a module-level "
        "`Detoxify` model, `GET /toxicity?q=` calling `model.predict([q])` synchronously, served by "
        "`gunicorn -k uvicorn.workers.UvicornWorker --workers <cores> --preload --keep-alive 30 --backlog 2048` "
        "with `OMP_NUM_THREADS=1`.",
        f"- **toxfleet**: `{' '.join(['uvicorn', 'api.main:app', *meta.get('api_options', [])])}` "
        "(1 process, no access log) + "
        "`celery -A worker worker` with "
        f"`TOXFLEET_CONCURRENCY=<cores>` and `TOXFLEET_BACKEND={meta.get('toxfleet_backend', 'torch')}`"
        + ("" if meta.get("toxfleet_backend", "torch") == "torch" else
           " (**not** the torch fp32 of the baseline and the ceiling: ratios compare different backends)")
        + " where a model's section names no other backend, the score cache off (`TOXFLEET_CACHE=false`: the "
        "corpus repeats, and the baseline has no cache), "
        "a private `redis-server`; settings: "
        + ", ".join(f"`{k}={v}`" for k, v in {**meta["worker_settings"], **meta["api_settings"]}.items())
        + (", environment " + ", ".join(f"`{k}={v}`" for k, v in meta["toxfleet_env"].items())
           if meta["toxfleet_env"] else "") + ".",
        "- The two systems never run at the same time; each gets the same cores, checkpoint and corpus.",
        "- **Closed loop** (`bench/load.py`): C clients, each sends the next text (one per request) when its "
        "previous answer arrives; the warm-up lasts until C answers arrived; a window counts requests "
        "*completed* in it. texts/s (counted) = answered texts / window; texts/s (token-normalised) = the "
        "corpus token lengths of those texts, summed, ÷ the corpus mean ÷ window.",
        "- **Open loop**: seeded Poisson arrivals; a window counts requests *issued* in it, each followed "
        "to its answer or its deadline. 429s are counted as refused (with their own latency), never as answers.",
        "- **Repeats**: each point runs several consecutive measurement windows under the same load; a figure is "
        "the median of its windows with the min–max range. `--rounds N` restarts both systems N times "
        "(alternating) and pools the windows. Ratios divide medians measured in the same run.",
        "- **CPU**: from /proc, the service's process tree (Redis included for toxfleet), in cores; the load "
        "generator's own CPU and everything else on the machine are reported beside it.",
        "- **Raw model ceiling**: `bench/ceiling.py`; the reference row is the baseline's per-request call "
        "(`Detoxify.predict([text])`) in the same processes, without a server.",
        "",
    ]
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines))


def _disturbance(results: dict[str, Any]) -> list[str]:
    """A warning when other programs used the machine's CPU during the measurements."""
    other = Spread.of([w["cpu"]["other"] for m in results["models"].values() for w in windows(m["points"])
                       if w.get("cpu")]
                      + [r["cpu"]["other"] for m in results["models"].values() for c in _ceiling_configs(m)
                         for r in c["runs"] if r.get("cpu")])
    if not other.n or other.median < DISTURBED_CPU:
        return []
    return [f"> **Disturbed run: indicative numbers only.** Other programs used {other.median:.2f} cores "
            f"(median over all windows; up to {other.high:.2f}) of this machine while it was measured; "
            "rerun on a quiet machine before drawing conclusions.", ""]


def _ceiling_configs(model: dict[str, Any]) -> list[dict[str, Any]]:
    c = model.get("ceiling") or {}
    return [*c.get("configs", []), *([c["reference"]] if c.get("reference") else [])]


def _backend_sentence(backend: dict[str, str] | None) -> str:
    """Which backend toxfleet ran for this model (results before per-model backends: the run's)."""
    if not backend or backend["runs"] == "torch" == backend["asked"]:
        return ""
    asked = "" if backend["asked"] == backend["runs"] else f"`TOXFLEET_BACKEND={backend['asked']}`: "
    return (f"toxfleet runs **`{backend['runs']}`** ({asked}{backend['why']}); the baseline and the ceiling run "
            "Detoxify's torch fp32, as the existing service does. ")


def _rel(path: Path, md: Path) -> str:
    return os.path.relpath(path, md.parent)


def _load(values: list[float]) -> str:
    return " / ".join(fmt_num(v, 2) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--report", type=Path, help="markdown file (default: benchmarks.md beside the results' folder)")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    md = args.report or args.results.parent.parent / f"{args.results.parent.name}.md"
    render(results, md, args.results.parent, str(args.results))


if __name__ == "__main__":
    main()
