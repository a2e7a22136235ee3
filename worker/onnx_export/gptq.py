"""GPTQ rounding (Frantar et al., 2022) of a per-column int8 weight: what `int8_graph.rowwise_int8` uses
when the export's recipe asks for it (`Int8Recipe.gptq`). numpy only."""

from __future__ import annotations

import numpy as np

GPTQ_DAMPING = 0.01
"""Added to X^T X's diagonal, as a share of its mean, before it is inverted (GPTQ's default)."""

GPTQ_BLOCK = 128
"""Input channels rounded between two lazy updates of the rest of the weight (GPTQ's block size)."""


def gptq_round(weight: np.ndarray, hessian: np.ndarray, scale: np.ndarray, levels: int) -> np.ndarray:
    """The integers of a [K, N] weight in [-levels, levels] at per-column `scale` (as
    `int8_graph.quantize_columns` sets them), rounded input channel by channel with each rounding's error
    pushed onto the channels not yet rounded, weighed by `hessian` (X^T X of the inputs, [K, K]). The
    product x @ W errs less on inputs like the calibration's than round-to-nearest, at the same integers'
    cost. Channels no input reaches round to zero."""
    w = weight.astype(np.float64).copy()
    k = w.shape[0]
    h = hessian.astype(np.float64).copy()
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    w[dead, :] = 0.0
    h[np.diag_indices(k)] += GPTQ_DAMPING * float(np.mean(np.diag(h)))
    upper = np.linalg.cholesky(np.linalg.inv(h)).T  # U with U^T U = H^-1
    s = np.asarray(scale, np.float64)
    q = np.zeros(w.shape, np.float64)
    for start in range(0, k, GPTQ_BLOCK):
        stop = min(start + GPTQ_BLOCK, k)
        errors = np.zeros((stop - start, w.shape[1]))
        for i in range(start, stop):
            q[i] = np.clip(np.rint(w[i] / s), -levels, levels)
            err = (w[i] - q[i] * s) / upper[i, i]
            w[i + 1:stop] -= np.outer(upper[i, i + 1:stop], err)
            errors[i - start] = err
        w[stop:] -= upper[start:stop, stop:].T @ errors
    out: np.ndarray = q.astype(np.int8)
    return out
