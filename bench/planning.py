"""Pass planning, checked: texts/s of one backend scoring worker-sized batches of corpus texts, planned
with its measured cost of a pass and with other per-pass overheads, interleaved in one process.

`worker.scorer.plan_passes` prices a pass as its padded tokens plus a fixed overhead, and a worker
fits that overhead from one-text passes (`measure_pass_overhead`). Matrix products run faster with
more rows, which that model leaves out; this shows what the choice costs against larger passes:

    TOXFLEET_CHECKPOINT=models/trained/model.ckpt TOXFLEET_HF_CONFIG=models/trained/hf \\
        .venv/bin/python -m bench.planning --backend onnx --batch 9 --overheads 32,64,256,1024
"""

from __future__ import annotations

import argparse
import statistics
import time

from fleet.corpus import CommentCorpus
from worker.backends.loader import load_backend
from worker.scorer import Scorer, measure_pass_overhead
from worker.settings import WorkerSettings

TEXTS = 240
"""Texts scored per setting and repeat, in batches of `--batch` in corpus order."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch", help="a TOXFLEET_BACKEND value other than auto")
    parser.add_argument("--batch", type=int, default=9, help="texts per batch (a worker's at 32 clients: ~9)")
    parser.add_argument("--overheads", default="32,64,256,1024", help="per-pass overheads to compare, in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    settings = WorkerSettings()
    backend = load_backend(args.backend, settings)
    measured = measure_pass_overhead(backend, settings.pass_tokens)
    overheads = [measured] + [int(x) for x in args.overheads.split(",") if x and int(x) != measured]
    corpus = CommentCorpus()
    texts = [corpus.text() for _ in range(TEXTS)]
    batches = [texts[i:i + args.batch] for i in range(0, TEXTS, args.batch)]
    print(f"{args.backend}: measured overhead {measured} tokens; {len(batches)} batches of {args.batch}")
    rates: dict[int, list[float]] = {o: [] for o in overheads}
    passes: dict[int, int] = {}
    for o in overheads:  # warm-up: the first pass of a shape allocates and picks kernels
        Scorer(backend, settings.pass_tokens, settings.pass_texts, o).score(batches[0])
    for repeat in range(args.repeats):
        for o in overheads if repeat % 2 == 0 else overheads[::-1]:  # alternate the order: drift cancels
            scorer = Scorer(backend, settings.pass_tokens, settings.pass_texts, o)
            passes[o] = 0
            started = time.perf_counter()
            for batch in batches:
                passes[o] += scorer.score(batch)[1].passes
            rates[o].append(TEXTS / (time.perf_counter() - started))
    print("| overhead (tokens) | passes | texts/s median [runs] |\n|---|---|---|")
    for o in overheads:
        label = f"{o} (measured)" if o == measured else str(o)
        print(f"| {label} | {passes[o]} | {statistics.median(rates[o]):.2f} {[round(r, 1) for r in rates[o]]} |")


if __name__ == "__main__":
    main()
