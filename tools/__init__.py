"""Developer tools, run as modules from the repository root (`python -m tools.synthetic`)."""
