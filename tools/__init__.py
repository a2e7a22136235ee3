"""Developer tools run as `python -m tools.<name>`: synthetic checkpoints, the backlog publisher."""
