"""What both tiers configure alike: one pydantic-settings base class, subclassed by `api.settings` and
`worker.settings`, so that a knob the API and the workers must agree on has one field and one default.

Server-side (pydantic-settings is in the `core` extra), hence here in `fleet`, not in the client package.
Environment variables are prefixed `TOXFLEET_` (plus `REDIS_URL`); each field's description is its
documentation, and the README's configuration table is generated from it (`python -m tools.readme`).
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet import redis_url as urls
from fleet.celeryconf import DEFAULT_VISIBILITY_TIMEOUT
from fleet.keys import DEFAULT_REDIS_URL
from toxfleet import contract


class SharedSettings(BaseSettings):
    """The fields the API and the workers share; give both tiers the same values."""

    model_config = SettingsConfigDict(env_prefix="TOXFLEET_", extra="ignore")

    redis_url: str = Field(
        DEFAULT_REDIS_URL, validation_alias=AliasChoices("REDIS_URL", "TOXFLEET_REDIS_URL"),
        description="Broker and result backend: `redis://`, `rediss://` (TLS), `unix://`, or Redis Sentinel as "
                    "`sentinel://[:password@]host:port[,host:port...][/db]?master=NAME` (the password is the "
                    "master's); Flower takes it from the workers' settings. ElastiCache: its primary endpoint as "
                    "`rediss://` (docs/reliability.md).")
    max_texts: int = Field(contract.MAX_TEXTS_PER_JOB, ge=1, le=100_000,
                           description="Most texts in one job (the API refuses more; a worker refuses a task "
                                       "message with more).")
    max_text_chars: int = Field(contract.MAX_TEXT_CHARS, ge=1, le=1_000_000,
                                description="Most characters per text (the model reads the first 512 tokens "
                                            "unless `long_text: \"windows\"`).")
    result_expires: int = Field(86_400, ge=60, le=30 * 86_400,
                                description="Seconds a job and its results are kept.")
    visibility_timeout: int = Field(
        DEFAULT_VISIBILITY_TIMEOUT, ge=5, le=86_400,
        description="Seconds before Redis redelivers a message whose worker died (after its last renewal: a live "
                    "worker renews every message it holds, buffered or being scored, every quarter of this, so a "
                    "slow batch or a long wait in the buffer is never redelivered). Sets the recovery time after a "
                    "whole worker dies: about this + 5 s + one batch (docs/reliability.md).")
    log_format: Literal["json", "text"] = Field(
        "text", description="`json`: one JSON object per log line, with the job id(s) (set in the Docker images); "
                            "`text`: for people (the worker's is Celery's).")
    cache: bool = Field(True, description="Score cache on: workers look texts up before scoring and store what "
                                          "they scored (docs/client.md); the API answers a job whose texts are all "
                                          "cached without a worker, only while every answering worker has it on.")
    cache_url: str | None = Field(None, description="Redis of the score cache (set the same on both tiers); "
                                                    "default: REDIS_URL.")

    @model_validator(mode="after")
    def _check_urls(self) -> Self:
        urls.check(self.redis_url, "REDIS_URL")
        if self.cache_url is not None:
            urls.check(self.cache_url, "TOXFLEET_CACHE_URL")
        return self
