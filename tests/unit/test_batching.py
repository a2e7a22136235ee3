"""How the worker's main process forms batches (pure logic: a stand-in pool records what it is given)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.batching import BatchTask


@dataclass
class _Request:
    id: str
    args: list[Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    request_dict: dict[str, Any] = field(default_factory=dict)
    delivery_info: dict[str, Any] = field(default_factory=dict)


class _Pool:
    def __init__(self, processes: int) -> None:
        self.num_processes = processes
        self.calls: list[list[str]] = []

    def apply_async(self, fn: Any, args: tuple[Any, ...], **_: Any) -> None:
        self.calls.append([r["id"] for r in args[2]])


def _task(processes: int, batch_tokens: int) -> tuple[BatchTask, _Pool]:
    task = BatchTask()
    pool = _Pool(processes)
    task._pool = pool
    task.batch_tokens = batch_tokens
    task.bulk_batch_tokens = 512
    return task, pool


def _buffer(task: BatchTask, costs: list[int], retries: dict[int, int] | None = None) -> None:
    for i, cost in enumerate(costs):
        req = _Request(f"r{i}", [["x"]], request_dict={"retries": (retries or {}).get(i, 0)})
        task._buffer.append((req, cost))  # type: ignore[arg-type]


def test_idle_processes_share_the_buffer() -> None:
    """Two idle processes and ten waiting requests: each gets about half, not one all of it."""
    task, pool = _task(2, batch_tokens=10_000)
    _buffer(task, [100] * 10)
    task._flush()
    assert [len(c) for c in pool.calls] == [5, 5]


def test_budget_caps_a_batch() -> None:
    """A busy buffer is cut into batches of at most batch_tokens (one process free at a time)."""
    task, pool = _task(1, batch_tokens=300)
    _buffer(task, [100] * 10)
    task._flush()
    assert pool.calls == [["r0", "r1", "r2"]]
    assert len(task._buffer) == 7


def test_no_dispatch_while_every_process_is_busy() -> None:
    """With as many batches in flight as processes, requests wait in the buffer."""
    task, pool = _task(2, batch_tokens=1000)
    task._in_flight.update({"a": ([], 100), "b": ([], 100)})
    _buffer(task, [100] * 3)
    task._flush()
    assert pool.calls == [] and len(task._buffer) == 3


def test_a_retried_request_runs_alone() -> None:
    """A request re-published after its pool process died is scored in a batch of its own."""
    task, pool = _task(1, batch_tokens=10_000)
    _buffer(task, [10, 10, 10], retries={1: 1})
    task._flush()
    assert pool.calls == [["r0"]]
    task._in_flight.clear()
    task._flush()
    assert pool.calls[-1] == ["r1"]


def test_an_oversized_request_still_goes() -> None:
    """A request over the budget is not stuck: it forms a batch of one."""
    task, pool = _task(1, batch_tokens=100)
    _buffer(task, [500, 10])
    task._flush()
    assert pool.calls == [["r0"]]


def test_a_process_freed_beside_a_long_batch_takes_only_its_share() -> None:
    """One process runs a batch of 1000 tokens; 3000 wait: the freed process takes its share of all
    the work in hand (2000), leaving the rest for its neighbour, rather than all 3000."""
    task, pool = _task(2, batch_tokens=100_000)
    task._in_flight["long"] = ([], 1000)
    _buffer(task, [100] * 30)
    task._flush()
    assert [len(c) for c in pool.calls] == [20]
    assert len(task._buffer) == 10


def test_interactive_requests_go_ahead_of_buffered_bulk_ones() -> None:
    """Bulk requests queue in arrival order; an interactive one goes before all of them, after
    interactive ones that came earlier."""
    task, pool = _task(1, batch_tokens=100)
    task.bulk_queues = frozenset({"bulk"})
    for name, queue in [("b0", "bulk"), ("b1", "bulk"), ("i0", "interactive"), ("b2", "bulk"), ("i1", None)]:
        task._enqueue(_Request(name, [["x"]], delivery_info={"routing_key": queue}), 100)  # type: ignore[arg-type]
    assert [r.id for r, _ in task._buffer] == ["i0", "i1", "b0", "b1", "b2"]
    task._flush()
    assert pool.calls == [["i0"]]


def test_bulk_work_goes_one_message_at_a_time() -> None:
    """Only bulk work waiting: a batch takes at most bulk_batch_tokens, so an interactive request that
    arrives next waits for one short call. Interactive work goes first, in calls of its own."""
    task, pool = _task(1, batch_tokens=10_000)
    task.bulk_queues = frozenset({"bulk"})
    task.bulk_batch_tokens = 250
    for i in range(6):
        req = _Request(f"b{i}", [["x"]], delivery_info={"routing_key": "bulk"})
        task._enqueue(req, 100)  # type: ignore[arg-type]
    task._flush()
    assert pool.calls == [["b0", "b1"]]
    task._in_flight.clear()
    for i in range(6):
        task._enqueue(_Request(f"i{i}", [["x"]]), 100)  # type: ignore[arg-type]
    task._flush()
    assert pool.calls[1] == [f"i{i}" for i in range(6)]  # ahead of the bulk work, and without it


class _Channel:
    closed = False


class _Message:
    def __init__(self, tag: str, channel: _Channel) -> None:
        self.delivery_tag = tag
        self.channel = channel


class _HeldRequest:
    """A request with a delivered message (hashable, as Celery's worker state needs)."""

    def __init__(self, id: str, channel: _Channel) -> None:
        self.id = id
        self.args: list[Any] = [["x"]]
        self.kwargs: dict[str, Any] = {}
        self.request_dict: dict[str, Any] = {"retries": 0}
        self.delivery_info: dict[str, Any] = {}
        self.message = _Message(f"tag-{id}", channel)
        self.acked = False

    def acknowledge(self) -> None:
        self.acked = True


class _CallbackPool(_Pool):
    def __init__(self, processes: int) -> None:
        super().__init__(processes)
        self.on_return: list[Any] = []

    def apply_async(self, fn: Any, args: tuple[Any, ...], **kw: Any) -> None:
        super().apply_async(fn, args)
        self.on_return.append(kw["callback"])


def test_renews_every_held_message_and_lets_a_deferred_one_go(monkeypatch: Any) -> None:
    """The main process renews the messages it holds, buffered and in a running batch; once a batch
    returns, a request it deferred (leased to another batch) is unacked but no longer renewed, so
    Redis redelivers it after the visibility timeout. A closed channel's messages are not renewed."""
    renewed: list[list[str]] = []
    monkeypatch.setattr("worker.batching.renew_deliveries", lambda channel, tags, now: renewed.append(sorted(tags)))
    task = BatchTask()
    pool = _CallbackPool(1)
    task._pool = pool
    task.batch_tokens = 100
    live, closed = _Channel(), _Channel()
    closed.closed = True
    r0, r1, gone = _HeldRequest("r0", live), _HeldRequest("r1", live), _HeldRequest("gone", closed)
    for req in (r0, r1, gone):
        task._buffer.append((req, 100))  # type: ignore[arg-type]
    task._flush()
    assert pool.calls == [["r0"]]
    task._renew_held()
    assert renewed == [["tag-r0", "tag-r1"]]
    pool.on_return[0]([{"state": "DEFERRED", "summary": "leased to another batch"}])
    assert not r0.acked and pool.calls[-1] == ["r1"]
    renewed.clear()
    task._renew_held()
    assert renewed == [["tag-r1"]]
