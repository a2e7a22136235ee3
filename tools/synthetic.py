"""Build Detoxify-format checkpoints with random weights, for offline tests and benchmarks.

Model weights cannot be downloaded everywhere toxfleet is developed, so this builds stand-ins that
Detoxify loads through its own code (`Detoxify(checkpoint=..., huggingface_config_path=...)`):

- `tiny`: a 2-layer ALBERT with the `unbiased-small` label layout; fast enough for unit tests.
- `unbiased-small` / `original-small`: the exact `albert-base-v2` architecture (12 x 768), as the real
  `-small` models; real compute, meaningless scores.
- `original`: the exact `bert-base-uncased` architecture with 6 outputs.

Each build writes `<out>/<kind>/model.ckpt` and `<out>/<kind>/hf/` (HF config and a tokenizer trained
here on the synthetic comment corpus). The checkpoint's `model_type` is the absolute path of `hf/`,
because Detoxify calls `config_class.from_pretrained(model_type)` even offline and that name must
resolve locally. **Scores from these checkpoints are meaningless**: only shapes, labels and compute
cost match the real models.

    python -m tools.synthetic tiny --out models
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.corpus import CommentCorpus
from toxfleet.contract import LABELS

UNBIASED_IDENTITY_CLASSES = ["male", "female", "homosexual_gay_or_lesbian", "christian", "jewish", "muslim",
                             "black", "white", "psychiatric_or_mental_illness"]
ORIGINAL_CLASSES = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]

TOKENIZER_TRAINING_TEXTS = 20_000
"""Synthetic comments a tokenizer is trained on; enough for a 30k vocabulary to settle."""

LOGIT_STD = 2.0
"""Spread given to the classifier's logits, so random-weight scores cover (0, 1) instead of all
sitting at 0.5, which would make equality tests weak."""


@dataclass(frozen=True)
class Kind:
    family: str  # "albert" or "bert"
    num_classes: int
    classes: list[str]
    arch: dict[str, Any]
    vocab_size: int
    identity_classes: list[str] | None = None


_ALBERT_BASE: dict[str, Any] = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                "intermediate_size": 3072, "embedding_size": 128}
_BERT_BASE: dict[str, Any] = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "intermediate_size": 3072}

KINDS: dict[str, Kind] = {
    "tiny": Kind("albert", 16, list(LABELS),
                 {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "intermediate_size": 64, "embedding_size": 16,
                  # A wider init makes a 2-layer model's features depend on the text, so the classifier
                  # needs no large rescaling (which would amplify float noise past 1e-4 comparisons).
                  "initializer_range": 0.5}, 2000, UNBIASED_IDENTITY_CLASSES),
    "unbiased-small": Kind("albert", 16, list(LABELS), _ALBERT_BASE, 30000, UNBIASED_IDENTITY_CLASSES),
    "original-small": Kind("albert", 6, ORIGINAL_CLASSES, _ALBERT_BASE, 30000),
    "original": Kind("bert", 6, ORIGINAL_CLASSES, _BERT_BASE, 30522),
}


def _train_tokenizer(kind: Kind, hf_dir: Path, seed: int) -> Any:
    from tokenizers import trainers  # heavy optional dependency (comes with transformers)

    transformers: Any = importlib.import_module("transformers")

    texts = CommentCorpus(seed).texts(TOKENIZER_TRAINING_TEXTS)
    if kind.family == "albert":
        specials = ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
        seed_tok = transformers.AlbertTokenizer()
        backend = seed_tok.backend_tokenizer
        backend.train_from_iterator(texts, trainers.UnigramTrainer(
            vocab_size=kind.vocab_size, special_tokens=specials, unk_token="<unk>", show_progress=False))
        vocab = [tuple(v) for v in json.loads(backend.to_str())["model"]["vocab"]]
        tokenizer = transformers.AlbertTokenizer(vocab=vocab, model_max_length=512)
    else:
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        seed_tok = transformers.BertTokenizer(vocab={t: i for i, t in enumerate(specials)})
        backend = seed_tok.backend_tokenizer
        backend.train_from_iterator(texts, trainers.WordPieceTrainer(
            vocab_size=kind.vocab_size, special_tokens=specials, show_progress=False))
        vocab_map = backend.get_vocab()
        tokenizer = transformers.BertTokenizer(vocab=vocab_map, model_max_length=512)
    tokenizer.save_pretrained(hf_dir)
    return tokenizer


def _spread_classifier(model: Any, tokenizer: Any, seed: int) -> None:
    """Rescale each label's classifier row so its logit has mean 0 and std LOGIT_STD across texts."""
    import torch  # heavy optional dependency: only building a checkpoint needs it

    texts = CommentCorpus(seed + 1).texts(64)
    inputs = tokenizer(texts, return_tensors="pt", truncation=True, max_length=512, padding=True)
    captured: list[Any] = []
    hook = model.classifier.register_forward_hook(lambda _m, args, _out: captured.append(args[0]))
    with torch.no_grad():
        model(**inputs)
        hook.remove()
        features = captured[0]
        projected = features @ model.classifier.weight.T
        scale = LOGIT_STD / projected.std(dim=0).clamp_min(1e-6)
        model.classifier.weight.mul_(scale[:, None])
        model.classifier.bias.copy_(-(projected.mean(dim=0) * scale))


def build(kind_name: str, out: Path, seed: int = 0) -> Path:
    """Build one synthetic checkpoint; returns the path of its `model.ckpt`."""
    import torch  # heavy optional dependency: only building a checkpoint needs it

    transformers: Any = importlib.import_module("transformers")
    kind = KINDS[kind_name]
    target = out.resolve() / kind_name
    hf_dir = target / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)

    tokenizer = _train_tokenizer(kind, hf_dir, seed)
    if kind.family == "albert":
        model_type_name, model_name, tokenizer_name = "albert", "AlbertForSequenceClassification", "AlbertTokenizer"
        config = transformers.AlbertConfig(vocab_size=kind.vocab_size, num_labels=kind.num_classes,
                                           max_position_embeddings=512, **kind.arch)
    else:
        model_type_name, model_name, tokenizer_name = "bert", "BertForSequenceClassification", "BertTokenizer"
        config = transformers.BertConfig(vocab_size=kind.vocab_size, num_labels=kind.num_classes,
                                         max_position_embeddings=512, **kind.arch)
    config.pad_token_id = tokenizer.pad_token_id
    model = getattr(transformers, model_name)(config).eval()
    _spread_classifier(model, tokenizer, seed)
    config.save_pretrained(hf_dir)

    dataset_args: dict[str, Any] = {"classes": kind.classes}
    if kind.identity_classes:
        dataset_args["identity_classes"] = kind.identity_classes
    checkpoint = {
        "config": {
            "name": f"synthetic-{kind_name}",
            "arch": {"type": model_type_name, "args": {
                "model_type": str(hf_dir), "model_name": model_name, "tokenizer_name": tokenizer_name,
                "num_classes": kind.num_classes}},
            "dataset": {"type": "synthetic", "args": dataset_args},
            "synthetic": {"kind": kind_name, "seed": seed,
                          "note": "random weights: scores are meaningless, compute cost is real"},
        },
        "state_dict": model.state_dict(),
    }
    path = target / "model.ckpt"
    torch.save(checkpoint, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--out", type=Path, default=Path("models"), help="parent directory (default: models)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build(args.kind, args.out, args.seed)
    print(f"TOXFLEET_CHECKPOINT={path}")
    print(f"TOXFLEET_HF_CONFIG={path.parent / 'hf'}")


if __name__ == "__main__":
    main()
