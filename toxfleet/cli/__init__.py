"""The `toxfleet` command (`toxfleet.cli.main:main`): bulk-score a JSONL or CSV file against a fleet, or
in-process with `--local` (the worker tier, loaded only then)."""
