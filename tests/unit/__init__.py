"""Pure logic: no Redis, no service processes, no model weights."""
