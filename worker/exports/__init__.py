"""Ahead-of-time ONNX exports of a Detoxify checkpoint, cached by its sha256.

    artifacts.py  layout, manifest, hashes and the verification a worker runs before loading one
    build.py      export, fusion, int8 quantization, check against torch (the `onnx` extra)
    cli.py        `python -m worker.exports`: build what is missing or stale, then run the gate
"""
