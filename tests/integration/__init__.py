"""Against real processes: a private Redis, Celery workers, uvicorn and Flower, and Detoxify itself on
the tiny synthetic checkpoint."""
