"""The `toxfleet` command: scoring files through a fleet (or locally), on top of the shared client."""
