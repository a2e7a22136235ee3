"""Where a Detoxify checkpoint's weights come from, and loading them through Detoxify's own code.

The worker's main process checks (and if need be downloads) the weights before it forks, without
importing torch; the export's layout is keyed by the same file (`worker.onnx_export.artifacts`); pool
processes and the export build load the model with `load_detoxify`.
"""

from __future__ import annotations

import logging
import os
import urllib.request
from pathlib import Path
from typing import Any

from worker.settings import WorkerSettings

logger = logging.getLogger(__name__)

DETOXIFY_URLS = {
    "original": "https://github.com/unitaryai/detoxify/releases/download/v0.1-alpha/toxic_original-c1212f89.ckpt",
    "unbiased": "https://github.com/unitaryai/detoxify/releases/download/v0.3-alpha/toxic_debiased-c7548aa0.ckpt",
    "multilingual": "https://github.com/unitaryai/detoxify/releases/download/v0.4-alpha/multilingual_debiased-0b549669.ckpt",
    "original-small": "https://github.com/unitaryai/detoxify/releases/download/v0.1.2/original-albert-0e1d6498.ckpt",
    "unbiased-small": "https://github.com/unitaryai/detoxify/releases/download/v0.1.2/unbiased-albert-c8519128.ckpt",
}
"""Detoxify's own weight URLs (copied so the main process need not import torch; a test keeps them equal)."""

NO_WEIGHTS_HELP = (
    "provide a Detoxify checkpoint with TOXFLEET_CHECKPOINT=<file.ckpt> and TOXFLEET_HF_CONFIG=<dir> "
    "(`python -m tools.synthetic tiny` builds an offline stand-in), or run where "
    "github.com and huggingface.co are reachable so Detoxify can download TOXFLEET_MODEL"
)


def torch_hub_checkpoint(url: str) -> Path:
    """Where torch.hub (and so Detoxify) keeps the weights downloaded from `url`."""
    torch_home = os.environ.get("TORCH_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "torch")
    return Path(torch_home) / "hub" / "checkpoints" / url.rsplit("/", 1)[1]


def check_weights(settings: WorkerSettings) -> None:
    """Exit with one clear line when no weights can be had, rather than fork processes that fail."""
    if settings.checkpoint is not None:
        return  # existence was checked by the settings
    url = DETOXIFY_URLS.get(settings.model)
    if url is None:
        raise SystemExit(f"toxfleet worker: unknown TOXFLEET_MODEL={settings.model!r} "
                         f"(known: {', '.join(DETOXIFY_URLS)})")
    target = torch_hub_checkpoint(url)
    if target.is_file():
        return
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise SystemExit(f"toxfleet worker: no weights for {settings.model!r} in {target.parent} and "
                         f"HF_HUB_OFFLINE=1; {NO_WEIGHTS_HELP}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    try:
        logger.info("downloading %s weights from %s", settings.model, url)
        with urllib.request.urlopen(url, timeout=30) as response, open(partial, "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        partial.rename(target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"toxfleet worker: cannot download {settings.model!r} weights ({exc}); "
                         f"{NO_WEIGHTS_HELP}") from None


def load_detoxify(settings: WorkerSettings) -> Any:
    """Load through Detoxify's own code: by name (downloads, or the torch hub cache) or offline from a
    Detoxify-format checkpoint plus a local HF config/tokenizer directory."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from detoxify import Detoxify  # heavy (torch, transformers): only where a model is really loaded

    if settings.checkpoint is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return Detoxify(checkpoint=str(settings.checkpoint),
                        huggingface_config_path=str(settings.hf_config) if settings.hf_config else None)
    return Detoxify(settings.model)
