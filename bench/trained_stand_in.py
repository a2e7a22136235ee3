"""Fine-tune a synthetic checkpoint on a synthetic multi-label task, to see how much of the fidelity
gate's verdict on random weights is the random weights.

Each of the model's outputs learns "one of three given mid-frequency words occurs in the text", on
comment-like texts from `fleet.corpus`. The result is a Detoxify-format checkpoint like the input
(same labels, tokenizer and architecture) whose features depend on the text. It is not a toxicity
model; it only has trained-model error statistics rather than random-weight ones.

    .venv/bin/python -m bench.trained_stand_in models/tiny models/tiny-trained --steps 600
    TOXFLEET_CHECKPOINT=models/tiny-trained/model.ckpt TOXFLEET_HF_CONFIG=models/tiny-trained/hf \\
        .venv/bin/python -m worker.gate

Cost: about 4 minutes for 600 steps of `tiny` on 2 shared cores; a full-size model needs far longer.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
from pathlib import Path

from fleet.corpus import CommentCorpus, vocabulary

WORDS_PER_LABEL = 3
TRAINING_TEXTS = 4000
BATCH = 32
MAX_TOKENS = 128
LEARNING_RATE = 2e-3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="directory with model.ckpt and hf/ (tools.synthetic output)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Heavy optional dependencies, imported after HF_HUB_OFFLINE is set.
    import torch
    from detoxify import Detoxify

    torch.manual_seed(0)
    rng = random.Random(0)
    checkpoint = torch.load(args.source / "model.ckpt", weights_only=False)
    detoxify = Detoxify(checkpoint=str(args.source / "model.ckpt"), huggingface_config_path=str(args.source / "hf"))
    model, tokenizer = detoxify.model.train(), detoxify.tokenizer
    vocab = vocabulary()
    words = [set(rng.sample(vocab[20:400], WORDS_PER_LABEL)) for _ in range(model.config.num_labels)]
    texts = CommentCorpus(99).texts(TRAINING_TEXTS)

    def target(text: str) -> list[float]:
        present = {w.strip(".,!?").lower() for w in text.split()}
        return [float(bool(present & label_words)) for label_words in words]

    targets = torch.tensor([target(t) for t in texts])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    for step in range(args.steps):
        idx = rng.sample(range(len(texts)), BATCH)
        inputs = tokenizer([texts[i] for i in idx], truncation=True, max_length=MAX_TOKENS, padding=True,
                           return_tensors="pt")
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(**inputs)[0], targets[idx])
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(args.source / "hf", args.out / "hf", dirs_exist_ok=True)
    checkpoint["state_dict"] = model.state_dict()
    checkpoint["config"]["arch"]["args"]["model_type"] = str((args.out / "hf").resolve())
    checkpoint["config"].setdefault("synthetic", {})["fine_tuned"] = {"steps": args.steps, "task": "word presence"}
    torch.save(checkpoint, args.out / "model.ckpt")
    print(f"TOXFLEET_CHECKPOINT={args.out / 'model.ckpt'}\nTOXFLEET_HF_CONFIG={args.out / 'hf'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
