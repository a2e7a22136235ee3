"""API configuration: one pydantic-settings class, read once, failing fast on unsafe values.

The fields the workers share come from `fleet.settings.SharedSettings`; each field's description is
its documentation, and the README's configuration table is generated from it (`python -m tools.readme`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Self

from pydantic import Field, SecretStr, model_validator

from fleet.settings import SharedSettings
from toxfleet.thresholds import DEFAULT_THRESHOLD, Thresholds, check_labels


class ApiSettings(SharedSettings):
    max_wait: float = Field(30.0, ge=0, le=300, description="Longest long-poll (`?wait=`) in seconds.")
    compat_timeout: float = Field(30.0, gt=0, le=300,
                                  description="How long the drop-in /toxicity endpoints wait for a result "
                                              "(then 504 `scoring-timeout`).")
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
    redis_timeout: float = Field(1.0, gt=0, le=30,
                                 description="Seconds before a Redis operation is given up (503 to the client).")
    redis_max_connections: int = Field(128, ge=4, le=10_000,
                                       description="Redis connections per API process (long-polls share one).")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024,
                                description="Largest request body accepted; larger ones get 413.")
    api_keys: SecretStr = Field(SecretStr(""), description="Comma-separated API keys (16 characters or more); "
                                "empty means no auth. When set, job and scoring routes need `Authorization: "
                                "Bearer <key>` (the /docs Authorize button), a job is visible only to the key that "
                                "created it (another key gets 404; the job stores a hash of the key, never the "
                                "key) and `Idempotency-Key` is scoped per key.")
    rate_limit: int = Field(0, ge=0, le=1_000_000,
                            description="Requests per second per API key (0: unlimited); 429 above it.")
    idempotency_ttl: int = Field(86_400, ge=60, le=30 * 86_400,
                                 description="Seconds an Idempotency-Key is remembered.")
    api_metrics_port: int = Field(9809, ge=0, le=65535,
                                  description="Port of the API's Prometheus endpoint (`/metrics`), a listener of its "
                                              "own, never the public one (9808 is the workers'); one API process "
                                              "per port (a second one exits at start, naming this variable); "
                                              "0: no metrics.")
    api_metrics_host: str = Field("127.0.0.1", min_length=1,
                                  description="Address that metrics listener binds: loopback for `make run`; the "
                                              "API image sets 0.0.0.0 so that Prometheus can reach it.")
    otel: bool = Field(False, description="FastAPI's native OpenTelemetry (spans, metrics, logs to the globally "
                       "configured providers). Off, FastAPI skips it; on, it also asks those providers on every "
                       "request, a cost even with none configured.")
    threshold: float = Field(DEFAULT_THRESHOLD, ge=0, le=1,
                             description="Probability at or above which a label is flagged, for every label "
                                         "not in `thresholds` (a request may override it).")
    thresholds: dict[str, float] = Field(default_factory=dict,
                                         description='Per-label thresholds as JSON, e.g. {"threat": 0.3}.')
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
        if any(len(k) < 16 for k in self.api_key_list):
            raise ValueError("TOXFLEET_API_KEYS: every key must have at least 16 characters")
        check_labels(self.thresholds, "TOXFLEET_THRESHOLDS")
        if self.submit_min_replicas and self.submit_replica_timeout >= self.redis_timeout:
            raise ValueError("TOXFLEET_SUBMIT_REPLICA_TIMEOUT must be less than TOXFLEET_REDIS_TIMEOUT "
                             "(the WAIT would be cut off by the socket timeout)")
        if self.rate_limit and not self.api_key_list:
            raise ValueError("TOXFLEET_RATE_LIMIT is per API key: set TOXFLEET_API_KEYS too")
        return self


@lru_cache(maxsize=1)
def get_settings() -> ApiSettings:
    return ApiSettings()
