"""API configuration: one pydantic-settings class, read once, failing fast on unsafe values.

Environment variables are prefixed `TOXFLEET_` (plus `REDIS_URL`); each field's description is its
documentation, and the README's table mirrors it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, Self

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet import redis_url as urls
from fleet.celeryconf import DEFAULT_VISIBILITY_TIMEOUT
from fleet.keys import DEFAULT_REDIS_URL
from toxfleet import contract
from toxfleet.thresholds import DEFAULT_THRESHOLD, Thresholds, check_labels


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOXFLEET_", extra="ignore")

    redis_url: str = Field(DEFAULT_REDIS_URL, validation_alias=AliasChoices("REDIS_URL", "TOXFLEET_REDIS_URL"),
                           description="Broker and result backend (redis:// or rediss://).")
    max_texts: int = Field(contract.MAX_TEXTS_PER_JOB, ge=1, le=100_000, description="Most texts in one job.")
    max_text_chars: int = Field(contract.MAX_TEXT_CHARS, ge=1, le=1_000_000, description="Most characters per text.")
    max_wait: float = Field(30.0, ge=0, le=300, description="Longest long-poll (`?wait=`) in seconds.")
    compat_timeout: float = Field(30.0, gt=0, le=300,
                                  description="How long the drop-in /toxicity endpoints wait for a result.")
    max_queue_depth: int = Field(10_000, ge=1, description="Absolute cap on waiting messages (queued or "
                                 "prefetched by workers); above it new jobs get 429.")
    backlog_per_process: int = Field(64, ge=1, le=100_000,
                                     description="Waiting messages (queued or prefetched) allowed per live worker "
                                                 "process; above it new jobs get 429, so accepted work keeps a "
                                                 "bounded wait. With no worker answering, one process is assumed.")
    max_loop_lag: float = Field(0.1, ge=0, le=60,
                                description="Seconds this API process's event loop may fall behind before new work "
                                            "(POST /v1/jobs, the /toxicity endpoints) gets a fast 429 `api-busy`, "
                                            "so that a saturated API sheds load instead of queueing it; 0: never.")
    retry_after: int = Field(1, ge=1, le=3600, description="Seconds suggested in Retry-After while a job runs.")
    result_expires: int = Field(86_400, ge=60, le=30 * 86_400,
                                description="Seconds a job and its results are kept (match the workers').")
    visibility_timeout: int = Field(DEFAULT_VISIBILITY_TIMEOUT, ge=5, le=86_400,
                                    description="Redis redelivery timeout (must match the workers').")
    redis_timeout: float = Field(1.0, gt=0, le=30,
                                 description="Seconds before a Redis operation is given up (503 to the client).")
    redis_max_connections: int = Field(128, ge=4, le=10_000,
                                       description="Redis connections per API process (long-polls share one).")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024,
                                description="Largest request body accepted; larger ones get 413.")
    api_keys: SecretStr = Field(SecretStr(""), description="Comma-separated API keys; empty means no auth. "
                                "When set, job and scoring routes need `Authorization: Bearer <key>`.")
    rate_limit: int = Field(0, ge=0, le=1_000_000,
                            description="Requests per second per API key (0: unlimited); 429 above it.")
    idempotency_ttl: int = Field(86_400, ge=60, le=30 * 86_400,
                                 description="Seconds an Idempotency-Key is remembered.")
    api_metrics_port: int = Field(9809, ge=0, le=65535,
                                  description="Port of the API's Prometheus endpoint (`/metrics`), a listener of its "
                                              "own, never the public one (9808 is the workers'); 0: no metrics.")
    api_metrics_host: str = Field("127.0.0.1", min_length=1,
                                  description="Address that metrics listener binds: loopback for `make run`; the "
                                              "API image sets 0.0.0.0 so that Prometheus can reach it.")
    otel: bool = Field(False, description="FastAPI's native OpenTelemetry (spans, metrics, logs to the globally "
                       "configured providers). Off, FastAPI skips it; on, it also asks those providers on every "
                       "request, which was ~3 % of the API's CPU with none configured.")
    log_format: Literal["json", "text"] = Field("text", description="`json`: one JSON object per log line, "
                                                "with the job id (set in the Docker images); `text`: for people.")
    threshold: float = Field(DEFAULT_THRESHOLD, ge=0, le=1,
                             description="Probability at or above which a label is flagged, for every label "
                                         "not in `thresholds` (a request may override it).")
    thresholds: dict[str, float] = Field(default_factory=dict,
                                         description='Per-label thresholds as JSON, e.g. {"threat": 0.3}.')
    cache: bool = Field(True, description="Answer a job whose texts are all in the score cache without a worker "
                                          "(only while every answering worker has its cache on).")
    cache_url: str | None = Field(None, description="Redis of the score cache (as the workers'); default: REDIS_URL.")
    submit_min_replicas: int = Field(0, ge=0, le=16,
                                     description="Replicas that must hold a job before its 202 (Redis `WAIT`); "
                                                 "fewer within `submit_replica_timeout`: 503 `not-replicated`. "
                                                 "0: no wait (the 202 follows the primary's write).")
    submit_replica_timeout: float = Field(0.5, gt=0, le=30,
                                          description="Seconds a submit waits for `submit_min_replicas` "
                                                      "(less than `redis_timeout`).")

    @property
    def base_thresholds(self) -> Thresholds:
        return Thresholds(self.threshold, self.thresholds)

    @property
    def api_key_list(self) -> list[str]:
        return [k.strip() for k in self.api_keys.get_secret_value().split(",") if k.strip()]

    @model_validator(mode="after")
    def _check(self) -> Self:
        urls.check(self.redis_url, "REDIS_URL")
        if any(len(k) < 16 for k in self.api_key_list):
            raise ValueError("TOXFLEET_API_KEYS: every key must have at least 16 characters")
        check_labels(self.thresholds, "TOXFLEET_THRESHOLDS")
        if self.cache_url is not None:
            urls.check(self.cache_url, "TOXFLEET_CACHE_URL")
        if self.submit_min_replicas and self.submit_replica_timeout >= self.redis_timeout:
            raise ValueError("TOXFLEET_SUBMIT_REPLICA_TIMEOUT must be less than TOXFLEET_REDIS_TIMEOUT "
                             "(the WAIT would be cut off by the socket timeout)")
        if self.rate_limit and not self.api_key_list:
            raise ValueError("TOXFLEET_RATE_LIMIT is per API key: set TOXFLEET_API_KEYS too")
        return self


@lru_cache(maxsize=1)
def get_settings() -> ApiSettings:
    return ApiSettings()
