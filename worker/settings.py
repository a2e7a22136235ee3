"""Worker configuration: one pydantic-settings class, read once, failing fast on unsafe values.

The fields the API shares come from `fleet.settings.SharedSettings`; each field's description is
its documentation, and the README's configuration table is generated from it (`python -m tools.readme`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Self

from pydantic import Field, model_validator

from fleet import cache as cache_defaults
from fleet.settings import SharedSettings
from toxfleet import contract
from worker.backends import registry


class WorkerSettings(SharedSettings):
    model: str = Field("unbiased-small", description="Detoxify model name, used when no checkpoint is given.")
    checkpoint: Path | None = Field(None, description="Detoxify-format .ckpt to load instead of downloading.")
    hf_config: Path | None = Field(None, description="Directory with the HF config and tokenizer (offline).")
    backend: str = Field(
        registry.AUTO,
        description="Inference backend: `auto` (the default): the fastest backend that passed the fidelity gate "
                    "for this checkpoint on this kind of CPU (`python -m worker.export` or the image build decides; "
                    "without a valid decision for this checkpoint, CPU and runtime, `auto` serves with `torch`, logs "
                    "why, and the runtime gate decides in the background: TOXFLEET_RUNTIME_GATE); or one by "
                    f"name: {', '.join(f'`{n}`' for n in registry.names())} (`torch` is fp32, exactly Detoxify's "
                    "model: the reference). See docs/backends.md.")
    export_dir: Path | None = Field(
        None,
        description="Directory holding ahead-of-time ONNX exports, one subdirectory per checkpoint sha256; "
                    "default: `exports/` next to the checkpoint. `python -m worker.export` writes it; a worker "
                    "writes it only for the runtime gate (an export it lacks, its `decision.json`, if writable).")
    concurrency: int | None = Field(None, ge=1, le=256,
                                    description="Worker processes; default: the physical cores the container may use "
                                                "(cgroup quota aware).")
    torch_threads: int = Field(1, ge=1, le=64,
                               description="Intra-op threads per process (torch and ONNX Runtime backends alike).")
    pass_tokens: int = Field(1024, ge=64, le=65536,
                             description="Most padded tokens (texts x longest) in one forward pass.")
    pass_texts: int = Field(16, ge=1, le=1024, description="Most texts in one forward pass.")
    pass_overhead_tokens: int | None = Field(
        None, ge=1, le=65536,
        description="What a forward pass costs beyond its padded tokens, in tokens: when splitting a batch into "
                    "passes pays. Default: timed on the backend when each pool process loads it (about a second).")
    batch_tokens: int = Field(8192, ge=512, le=1_000_000,
                              description="Most estimated tokens a worker process takes from its buffer at once "
                                          "(large batches sort into passes with little padding).")
    bulk_batch_tokens: int = Field(512, ge=64, le=1_000_000,
                                   description="Most estimated tokens a process takes at once when only bulk work "
                                               "waits (about one 512-token message): a batch is not interrupted, "
                                               "so this bounds an interactive job's wait behind a backfill.")
    prefetch_multiplier: int = Field(16, ge=1, le=10_000,
                                     description="Celery prefetch per process (messages): about one full batch of "
                                                 "512-token messages per process. Higher fills batches of short "
                                                 "texts better, but a busy worker then holds backlog that a worker "
                                                 "started to scale out should take.")
    process_start_timeout: float = Field(120.0, ge=5, le=3600,
                                         description="Seconds a new pool process may take to load the model.")
    sweep_seconds: float = Field(10.0, ge=0, le=3600,
                                 description="How often a worker looks for task messages Redis lost (popped by a "
                                             "worker killed before it could record them) and re-publishes them "
                                             "(worker/sweeper.py); 0: never.")
    max_retries: int = Field(2, ge=0, le=10,
                             description="Re-deliveries after a worker process died mid-batch, before failing.")
    metrics_port: int = Field(9808, ge=0, le=65535,
                              description="Port of the worker's Prometheus endpoint (all its processes); 0: none.")
    execution_log: Path | None = Field(
        None, description="Test and benchmark instrument, off in production: a file to which every batch appends "
                          "one JSON line (batch id, pid, the request ids it claimed) before it scores "
                          "(worker/executions.py); the fault suite and the soak count requests scored twice from it.")
    cache_ttl: int = Field(cache_defaults.DEFAULT_TTL, ge=1, le=365 * 86_400,
                           description="Seconds a cached score lives.")
    cache_max_entries: int = Field(cache_defaults.DEFAULT_MAX_ENTRIES, ge=1, le=1_000_000_000,
                                   description="Most cached scores kept (about 0.7 KB each); the oldest go first.")

    # The runtime fidelity gate (`worker.gate.background`): with `auto` and no valid decision, the fleet
    # gates its kind of CPU itself, one worker at a time, at low priority, while it serves with `torch`.
    runtime_gate: bool = Field(True, description="With `auto` and no valid decision for this checkpoint and CPU: "
                                                 "adopt one another worker published in Redis, or gate this kind "
                                                 "of CPU in the background (one worker per kind) and switch the "
                                                 "pool processes to the winner between batches. Off: `auto` "
                                                 "runs `torch` until `python -m worker.export` decides.")
    gate_texts: int | None = Field(None, ge=8, le=100_000,
                                   description="Texts in the runtime gate's corpus; default: the gate's own "
                                               "(`python -m worker.gate --texts`).")
    gate_backends: str | None = Field(None, description="Comma-separated backends the runtime gate measures "
                                                        "against `torch`; default: every gate candidate.")
    gate_nice: int = Field(19, ge=0, le=19,
                           description="CPU priority (nice) of the runtime gate's subprocess: 19, the lowest, lets it "
                                       "use only what the pool processes leave idle; lower finishes sooner on a busy "
                                       "host at the cost of serving.")
    gate_timeout: float = Field(3600.0, ge=10, le=86_400,
                                description="Seconds a runtime gate (export included) may run before it is "
                                            "killed and counted as failed.")
    gate_retry_seconds: float = Field(60.0, ge=1, le=86_400,
                                      description="Wait after a failed runtime gate before the fleet tries again; "
                                                  "doubled after each further failure.")
    gate_retry_max_seconds: float = Field(3600.0, ge=1, le=7 * 86_400,
                                          description="Longest wait between two runtime gates that failed.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.checkpoint is None) != (self.hf_config is None) and self.hf_config is not None:
            raise ValueError("TOXFLEET_HF_CONFIG needs TOXFLEET_CHECKPOINT")
        if self.checkpoint is not None and not self.checkpoint.is_file():
            raise ValueError(f"TOXFLEET_CHECKPOINT={self.checkpoint} is not a file")
        if self.hf_config is not None and not self.hf_config.is_dir():
            raise ValueError(f"TOXFLEET_HF_CONFIG={self.hf_config} is not a directory")
        if self.backend not in registry.setting_values():
            raise ValueError(f"TOXFLEET_BACKEND={self.backend!r} is not one of {', '.join(registry.setting_values())}")
        if self.gate_backends is not None:
            unknown = [b for b in self.gate_backends.split(",") if b and b not in registry.names()]
            if unknown:
                raise ValueError(f"TOXFLEET_GATE_BACKENDS: {', '.join(unknown)} not among "
                                 f"{', '.join(registry.names())}")
        if self.pass_tokens < contract.MODEL_MAX_TOKENS:
            raise ValueError(f"TOXFLEET_PASS_TOKENS must be at least {contract.MODEL_MAX_TOKENS} (one full text)")
        return self

    @property
    def renew_seconds(self) -> float:
        """Seconds between two renewals of the held messages in kombu's unacked index (worker.batching):
        a quarter of the visibility timeout, so that a main process may miss two renewals in a row (a
        stall on a loaded host) and still keep its messages."""
        return self.visibility_timeout / 4

    @property
    def lease_seconds(self) -> int:
        """How long a batch's lease on a request lasts (renewed every third of it while the batch runs,
        worker.results): half the visibility timeout. A worker killed -9 renewed its messages and its
        leases at most a moment before it died; its messages come back no earlier than the visibility
        timeout minus one renewal period (3/4 of it) after that, when the leases (1/2) have expired, so
        a redelivered request is claimed at once instead of deferred for a second visibility timeout.
        The quarter between the two absorbs clock skew between hosts and a late renewal."""
        return max(self.visibility_timeout // 2, 2)

    @property
    def model_identity(self) -> str:
        """How results name the model: the Detoxify name, or the checkpoint file name."""
        if self.checkpoint is None:
            return self.model
        return f"checkpoint:{self.checkpoint.parent.name}/{self.checkpoint.name}"


@lru_cache(maxsize=1)
def get_settings() -> WorkerSettings:
    return WorkerSettings()
