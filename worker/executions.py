"""An instrument for the fault suite and the soak: every batch appends one line to a file before it
scores, naming the requests it claimed, so that a request scored more than once (by a batch killed
mid-way and by the batch that scored it again) can be counted from the workers' own record rather
than from the results they publish (only the first final result of a request is ever stored).

A local file, not Redis: the record must outlive the broker faults it is read after (a Redis restarted
empty, a failover that loses the last writes). Off unless `TOXFLEET_EXECUTION_LOG` names the file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path


def record(path: Path | None, batch_id: str, task_ids: Sequence[str]) -> None:
    """Append `{"batch", "pid", "t", "tasks"}` as one line (one write with O_APPEND: lines of
    concurrent processes never interleave); nothing when `path` is None or no request was claimed."""
    if path is None or not task_ids:
        return
    line = json.dumps({"batch": batch_id, "pid": os.getpid(), "t": time.time(), "tasks": list(task_ids)}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
