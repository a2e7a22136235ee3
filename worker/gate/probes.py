"""The gate corpus's texts: comment-like texts of mixed lengths with injected phrases.

Each phrase carries, per Detoxify `original` label, the probability that a text holding it is
labelled so. `tools.trained` fine-tunes its trained checkpoint on texts labelled from this table, and
the fidelity gate (`worker.gate.fidelity.gate_texts`) judges backends on `probe_texts`: on a model
trained on them many of these texts sit near a threshold, which is where reduced precision shows.
Generating them needs nothing but `fleet.corpus` (no training data, no model).
"""

from __future__ import annotations

import random

from fleet.corpus import CommentCorpus

ORIGINAL_CLASSES = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]
"""Detoxify `original` labels as stored in a checkpoint (Detoxify renames some on output)."""

# Phrase -> probability of each label (toxic, severe_toxic, obscene, threat, insult, identity_hate).
# Strong phrases are near 0 or 1; ambiguous ones sit between, which is what gives a trained model
# its band of scores near the thresholds. Labels correlate through shared phrases.
PHRASES: dict[str, tuple[float, float, float, float, float, float]] = {
    "you are an idiot": (0.97, 0.10, 0.05, 0.0, 0.95, 0.0),
    "what a pathetic loser": (0.95, 0.15, 0.05, 0.0, 0.90, 0.0),
    "shut up you moron": (0.97, 0.20, 0.10, 0.0, 0.90, 0.0),
    "this is total garbage": (0.75, 0.0, 0.05, 0.0, 0.20, 0.0),
    "what the hell is wrong with you": (0.85, 0.05, 0.50, 0.0, 0.50, 0.0),
    "damn this crap": (0.80, 0.0, 0.85, 0.0, 0.10, 0.0),
    "filthy disgusting pig": (0.97, 0.60, 0.60, 0.0, 0.90, 0.05),
    "i will find you and hurt you": (0.95, 0.60, 0.0, 0.97, 0.20, 0.0),
    "watch your back": (0.60, 0.10, 0.0, 0.55, 0.05, 0.0),
    "you will regret this": (0.45, 0.0, 0.0, 0.40, 0.05, 0.0),
    "people of your religion are vermin": (0.97, 0.70, 0.05, 0.05, 0.60, 0.97),
    "go back to your country": (0.80, 0.10, 0.0, 0.05, 0.30, 0.75),
    "those immigrants ruin everything": (0.60, 0.05, 0.0, 0.0, 0.10, 0.55),
    "kind of dumb honestly": (0.50, 0.0, 0.0, 0.0, 0.45, 0.0),
    "nobody asked you": (0.45, 0.0, 0.0, 0.0, 0.35, 0.0),
    "get lost": (0.40, 0.0, 0.0, 0.05, 0.20, 0.0),
    "this sucks": (0.35, 0.0, 0.30, 0.0, 0.0, 0.0),
}

BENIGN_PHRASES = ["thanks for sharing", "i respectfully disagree", "great point", "have a nice day",
                  "this is a fair question", "i love this community"]
"""Inserted into clean texts too, so the model learns phrases, not 'any English means toxic'."""


def labelled_text(rng: random.Random, corpus: CommentCorpus, toxic_fraction: float,
                  max_words: int | None) -> tuple[str, list[float]]:
    """One comment (cut to `max_words` words if given) with 0-2 injected phrases, and its labels
    (each drawn from the phrases' probabilities, OR-ed)."""
    words = corpus.text().split()
    if max_words is not None:
        words = words[: rng.randint(3, max_words)]
    labels = [0.0] * len(ORIGINAL_CLASSES)
    inserts: list[str] = []
    if rng.random() < toxic_fraction:
        for phrase in rng.sample(sorted(PHRASES), 1 if rng.random() < 0.8 else 2):
            inserts.append(phrase)
            for i, p in enumerate(PHRASES[phrase]):
                if rng.random() < p:
                    labels[i] = 1.0
    if rng.random() < 0.3:
        inserts.append(rng.choice(BENIGN_PHRASES))
    for phrase in inserts:
        # Within the first 30 words, so a 512-token truncation never cuts the phrase off. A later
        # insert may split an earlier phrase: a little label noise, kept (it is part of the recipe).
        at = rng.randint(0, min(len(words), 30))
        words[at:at] = phrase.split()
    return " ".join(words), labels


def probe_texts(n: int, seed: int = 7) -> list[str]:
    """Full-length comment-like texts of mixed lengths, most carrying a phrase (many ambiguous, so
    near a threshold): the texts fidelity is judged on."""
    rng = random.Random(seed)
    corpus = CommentCorpus(seed)
    return [labelled_text(rng, corpus, 0.7, None)[0] for _ in range(n)]
