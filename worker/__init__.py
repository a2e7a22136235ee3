"""toxfleet's inference tier: Celery workers that score batched requests with Detoxify.

`celery -A worker ...` finds the app as `worker.app`. It is imported lazily, so that tools in this
package (`python -m worker.synthetic`) run without a valid worker configuration.
"""

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from worker.celery_app import app

        return app
    raise AttributeError(name)
