"""toxfleet's HTTP tier: validates input, enqueues scoring jobs by task name, answers at once.

It never imports torch, transformers, detoxify or `worker` (a test enforces it): the only thing it
shares with the workers is `toxfleet.contract`. The ASGI app is `api.main:app`.
"""
