"""Ahead-of-time ONNX exports of a Detoxify checkpoint, cached by its sha256.

    artifacts.py  layout, manifest, hashes and the verification a worker runs before loading one
    build.py      export, fusion, int8 quantization, check against torch (the `onnx` extra)

The command that builds them and then runs the fidelity gate is `python -m worker.export`
(`worker/export.py`, on top of both this package and `worker.gate`).
"""
