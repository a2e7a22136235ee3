"""Greedy splitting under a budget: the one way toxfleet cuts a sequence into consecutive batches
(the API's task messages, the client's jobs, the CLI's row batches)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def split(items: Iterable[T], cost: Callable[[T], int], budget: int, max_items: int) -> Iterator[list[T]]:
    """Consecutive batches, in order, each of at most `max_items` items whose `cost`s add up to at
    most `budget` (an item over the budget on its own still forms a batch of its own). Lazy: a batch
    is yielded as soon as the next item does not fit."""
    batch: list[T] = []
    used = 0
    for item in items:
        c = cost(item)
        if batch and (len(batch) >= max_items or used + c > budget):
            yield batch
            batch, used = [], 0
        batch.append(item)
        used += c
    if batch:
        yield batch
