"""The trained test checkpoint's recipe (`tools.trained`) and the gate's probe texts
(`worker.gate.probes`): labels, cache key, schedule. Pure logic: no model, no wheel."""

from __future__ import annotations

import random

import pytest

from fleet.corpus import CommentCorpus
from tools.trained import Recipe, _lr_factor, recipe_hash
from worker.gate.probes import ORIGINAL_CLASSES, PHRASES, labelled_text, probe_texts


def test_labels_follow_the_injected_phrases():
    rng = random.Random(0)
    corpus = CommentCorpus(0)
    examples = [labelled_text(rng, corpus, 0.55, 40) for _ in range(400)]
    for _, labels in examples:
        assert len(labels) == len(ORIGINAL_CLASSES) and set(labels) <= {0.0, 1.0}
    # A later insert may land inside an earlier phrase (a little label noise, as real annotation
    # has), so about 94 %, not all, labelled texts hold an intact phrase.
    labelled = [text for text, labels in examples if any(labels)]
    intact = sum(any(phrase in text for phrase in PHRASES) for text in labelled)
    assert intact >= 0.9 * len(labelled)
    toxic = sum(labels[0] for _, labels in examples) / len(examples)
    assert 0.25 < toxic < 0.6
    # Correlated labels: a severe_toxic text is nearly always toxic too.
    severe = [labels for _, labels in examples if labels[1]]
    assert severe and sum(labels[0] for labels in severe) / len(severe) > 0.8


def test_phrase_probabilities_are_probabilities():
    for probabilities in PHRASES.values():
        assert len(probabilities) == len(ORIGINAL_CLASSES)
        assert all(0.0 <= p <= 1.0 for p in probabilities)


def test_probe_texts_are_reproducible_and_of_mixed_lengths():
    texts = probe_texts(200)
    assert texts == probe_texts(200)
    lengths = sorted(len(t.split()) for t in texts)
    assert lengths[10] < 20 and lengths[-10] > 150


def test_recipe_hash_changes_with_the_recipe_and_the_weights():
    base = recipe_hash(Recipe(), "a" * 64)
    assert base == recipe_hash(Recipe(), "a" * 64)
    assert base != recipe_hash(Recipe(steps=7), "a" * 64)
    assert base != recipe_hash(Recipe(), "b" * 64)


def test_learning_rate_warms_up_then_decays_to_zero():
    recipe = Recipe(steps=100, warmup=10)
    factors = [_lr_factor(s, recipe) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[-1] == pytest.approx(1 / 90)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:], strict=False))
