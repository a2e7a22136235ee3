"""The fidelity gate: which backend `TOXFLEET_BACKEND=auto` may run, and why.

    decision.py   the gate's verdict for one checkpoint on one kind of CPU (decision.json)
    fidelity.py   every backend against the torch fp32 reference, timed and judged
    compare.py    the one comparison of a candidate's scores against the reference's
    record.py     where a gate run spent its time, and its progress lines
    selection.py  what `auto` resolves to in a worker: a decision that still holds, or the reference
    cli.py        `python -m worker.gate`: run the gate, print its table, write the decision
"""
