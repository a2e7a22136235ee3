"""Server-side code both tiers share: Redis keys and clients, the broker transport, the
job manifest, the score cache, Celery settings, logging, settings. Never installed into a
client's site-packages: it ships in the images and runs from the checkout beside `api/`
and `worker/` (the client package is `toxfleet`, which imports nothing from here)."""
