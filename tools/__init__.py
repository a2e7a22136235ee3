"""Developer and operations tools run with `python -m tools.<name>` (not imported by the tiers)."""
