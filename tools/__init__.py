"""Developer tools, run as `python -m tools.<name>` from the repository root: synthetic checkpoints, the backlog publisher."""
