"""A run killed by CI's overall timeout (SIGTERM) leaves no process behind: the children the tests
start live in sessions of their own (so a terminal's Ctrl-C reaches only pytest), which a signal to
the run's process group never reaches; `reap_on_term` kills their groups itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from testing import ROOT, wait_for
from testing.processes import group_members

SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from testing.processes import Proc, reap_on_term
    reap_on_term()
    # A leader with a child of its own, as a Celery worker has its pool processes.
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    code = f"import subprocess, time; subprocess.Popen({sleep!r}); time.sleep(60)"
    leader = Proc("leader", [sys.executable, "-c", code], dict(os.environ), Path(sys.argv[1])).start()
    print(leader.proc.pid, flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt as exc:
        print("interrupted:", exc, flush=True)
""")


def test_sigterm_kills_every_child_group_and_interrupts(tmp_path: Path) -> None:
    run = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "leader.log")], cwd=ROOT,
                           stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.stdout is not None
    pgid = int(run.stdout.readline())  # the leader's pid: its session's and group's id
    wait_for(lambda: len(group_members(pgid)) == 2, 10, "the leader and its child")
    run.send_signal(signal.SIGTERM)
    out, _ = run.communicate(timeout=10)
    assert "interrupted: signal 15" in out
    wait_for(lambda: group_members(pgid) == [], 5, "the leader's group to be gone")
