"""Inference backends: the same Detoxify weights run different ways, behind one contract.

    base.py      the contract (`Backend`: tokenize, predict a padded batch) and the precision classes
    torch.py     the reference: Detoxify's own torch model in fp32 (its weights: `worker.weights`)
    reduced.py   the reference's model in int8 (dynamic quantization) or bf16 (autocast)
    compiled.py  the reference's model compiled by TorchInductor, in fp32 or bf16
    onnx.py      the ahead-of-time ONNX export (`worker.onnx_export`) on ONNX Runtime, fp32 or int8
    loader.py    builds a backend by its resolved name (`auto` is resolved above, in `worker.gate`)

Importing any of these loads no torch, ONNX Runtime or transformers: each backend imports its
runtime when it is built, in the process that will use it.
"""
