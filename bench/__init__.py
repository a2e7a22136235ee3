"""The toxfleet benchmark harness: `python -m bench.run` (see docs/benchmarks.md).

Measures, on the same cores, corpus and checkpoint: the existing service's design (`baseline_app`),
the raw model ceiling (`ceiling`), and toxfleet through its public HTTP API, with a closed- and an
open-loop load generator (`load`). `report` renders the results as tables and plots.
"""
