"""The torch fp32 reference's scores of the gate corpus, kept in the checkpoint's export directory
(`REFERENCE_FILE`), so that the gate on every other CPU reuses them instead of scoring the corpus again.

They depend on the checkpoint, the corpus, how it is cut into padded passes, and the versions of the
packages that build the model and its tokenizer: the key (`reference_key`) holds each. Not on the CPU:
fp32 scores of the same passes differ across CPUs only in summation order, far inside every budget
(docs/backends.md). A file made for anything else, or unreadable, is ignored with a line saying why,
and the reference scores the corpus again. The reference's speed is never kept: it is the bar the
candidates must beat on this CPU. `python -m worker.export` writes the file; nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from worker.cpus import cpu_model_name
from worker.onnx_export.artifacts import installed_version

REFERENCE_FORMAT = 1
"""Version of the file's layout; another version is ignored."""

REFERENCE_VERSIONS = ("torch", "transformers", "detoxify")
"""Packages whose version can change the reference's model or tokenizer, hence its scores."""


def corpus_digest(texts: Sequence[str]) -> str:
    """sha256 of the corpus, text by text: the key's proof that the same texts were scored."""
    digest = hashlib.sha256()
    for text in texts:
        encoded = text.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()


def reference_key(checkpoint_sha256: str, texts: Sequence[str], seed: int | None, pass_tokens: int,
                  pass_texts: int, overhead_tokens: int, check_texts: int) -> dict[str, Any]:
    """Everything the reference's gate scores depend on; a kept file holds only for an equal key."""
    return {
        "format": REFERENCE_FORMAT,
        "checkpoint_sha256": checkpoint_sha256,
        "corpus": {"seed": seed, "texts": len(texts), "sha256": corpus_digest(texts)},
        "passes": {"pass_tokens": pass_tokens, "pass_texts": pass_texts, "overhead_tokens": overhead_tokens},
        "check_texts": check_texts,
        "versions": {dist: installed_version(dist) for dist in REFERENCE_VERSIONS},
    }


@dataclass
class ReferenceScores:
    """The reference's scores of one corpus, and of its first texts one per pass (its own check)."""

    key: dict[str, Any]
    labels: list[str]
    scores: list[list[float]]
    """One row per corpus text, in label order, from the corpus cut into the configured padded passes."""
    alone: list[list[float]]
    """The first `check_texts` texts scored one per pass (no padding at all)."""
    seconds: float
    """How long scoring them took where they were made."""
    cpu: str = field(default_factory=cpu_model_name)
    """Where they were made (a record only: the CPU is not part of the key)."""
    created: float = field(default_factory=time.time)

    def write(self, path: Path) -> Path:
        """Write atomically (a gate reading it meanwhile sees the old file or the new one)."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self), sort_keys=True))
        tmp.replace(path)
        return path


def read_reference(path: Path, key: dict[str, Any]) -> ReferenceScores | str:
    """The scores kept at `path` if they were made for `key` and are whole; else why not."""
    if not path.is_file():
        return f"no reference scores at {path}"
    try:
        kept = ReferenceScores(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        return f"unreadable reference scores at {path} ({type(exc).__name__}: {exc})"
    mismatch = _mismatch(kept.key, key) if isinstance(kept.key, dict) else "no key"
    if mismatch is not None:
        return f"reference scores at {path} were made {mismatch}"
    texts, check = key["corpus"]["texts"], min(key["check_texts"], key["corpus"]["texts"])
    if not (_rows(kept.scores, texts, len(kept.labels)) and _rows(kept.alone, check, len(kept.labels))):
        return f"reference scores at {path} are incomplete or not finite"
    return kept


def _mismatch(kept: dict[str, Any], wanted: dict[str, Any]) -> str | None:
    """What differs between a kept key and the wanted one, in words; None if nothing."""
    if kept.get("format") != wanted["format"]:
        return f"in format {kept.get('format')}, this gate reads {wanted['format']}"
    if kept.get("checkpoint_sha256") != wanted["checkpoint_sha256"]:
        return (f"for checkpoint sha256 {str(kept.get('checkpoint_sha256'))[:12]}, this one is "
                f"{wanted['checkpoint_sha256'][:12]}")
    if kept.get("corpus") != wanted["corpus"]:
        return f"on another corpus ({_corpus(kept.get('corpus'))}; this gate's: {_corpus(wanted['corpus'])})"
    if kept.get("passes") != wanted["passes"] or kept.get("check_texts") != wanted["check_texts"]:
        return (f"with other passes ({kept.get('passes')}, check {kept.get('check_texts')}; this gate's: "
                f"{wanted['passes']}, check {wanted['check_texts']})")
    if kept.get("versions") != wanted["versions"]:
        return f"with {kept.get('versions')}, this gate runs {wanted['versions']}"
    if kept != wanted:
        return f"under another key ({kept})"
    return None


def _corpus(corpus: Any) -> str:
    if not isinstance(corpus, dict):
        return repr(corpus)
    return f"{corpus.get('texts')} texts, seed {corpus.get('seed')}, sha256 {str(corpus.get('sha256'))[:12]}"


def _rows(rows: Any, count: int, labels: int) -> bool:
    """Whether `rows` is `count` rows of `labels` finite probabilities."""
    return (isinstance(rows, list) and len(rows) == count and labels > 0
            and all(isinstance(row, list) and len(row) == labels
                    and all(isinstance(v, float | int) and math.isfinite(v) for v in row) for row in rows))
