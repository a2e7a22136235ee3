"""Per-row int8 for an ONNX graph: every Linear MatMul gets one activation scale per token (row), one
weight scale per output column, and optionally SmoothQuant factors, in ONNX ops ONNX Runtime's CPU
kernels run (MatMulIntegerToFloat on MLAS' u8 x s8 GEMM, VNNI where the CPU has it).

Why not ONNX Runtime's own quantizers: `quantize_dynamic` (`DynamicQuantizeLinear` +
`MatMulIntegerToFloat`) computes ONE activation scale per tensor per call, so in a padded pass one
text's outlier token coarsens every text beside it; on trained weights that misses the fidelity gate
by far (docs/history.md, the int8 recipes). ORT's `MatMulInteger` CPU kernel takes only a scalar `a_zero_point`,
and `MatMulIntegerToFloat` only a scalar `a_scale`, so per-row scales are written out:

    xs = x * inv_smooth                       (SmoothQuant, when calibrated; one per input channel)
    r  = max(ReduceMax(Abs(xs), -1) / 127, 1e-12)               one scale per row [.., 1]
    q  = QuantizeLinear(xs / r, 1.0, uint8 128)                 symmetric int8, stored +128 as uint8
    y  = MatMulIntegerToFloat(q, Wq, 1.0, w_scale, 128) * r     int32 accumulate, rescale

(MatMulIntegerToFloat, ONNX Runtime's contrib op, applies the per-column scale in the GEMM's output pass:
the same floats as MatMulInteger, Cast and Mul, without two passes over the output.)

With outlier channels O (the calibration's largest max |x_j|), inv_smooth is 0 on O, so they set no
row's scale, and y += Gather(x, O) @ W[O, :] in fp32.

Wq = round(W * smooth / w_scale) in int8 (rows O zeroed), per output column. MatMuls that read the same tensor share
one row quantization, and MatMuls that share a tensor or a weight (ALBERT shares its layer's weights
across layers) share one smoothing vector, so each weight is quantized once.

`activation_maxima` is the calibration: the fp32 graph run on calibration texts with every MatMul
input exposed, max |x_j| per channel. Importing this module loads neither onnx nor onnxruntime.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from worker.onnx_export.gptq import gptq_round

INT8_MAX = 127
"""Symmetric int8 range [-127, 127] (the uint8 storage is that + 128: 1..255)."""

ZERO_POINT = 128

INT7_MAX = 63
"""Symmetric 7-bit range [-63, 63]. Without int8 dot products (VNNI, AMX), ONNX Runtime's x86 kernels
multiply uint8 activations by int8 weights with `vpmaddubsw`, which sums each pair of products in
saturating int16: 255 * 127 * 2 overflows 32,767, while 255 * 63 * 2 and 127 * 127 * 2 do not. So either
weights or activations in 7 bits make the product exact there (docs/int8-recipes.md)."""

OUTLIER_SHARE = 8
"""At most 1/OUTLIER_SHARE of a MatMul's input channels are kept fp32 as outliers, so a narrow model
keeps most of its product in int8."""

GELU_FLOOR = 0.1701
"""A little over -min GELU(x) (0.16997, at x = -0.75; the tanh form's is the same to 1e-4)."""

INT8_MATMUL = "MatMulIntegerToFloat"
"""The op each Linear becomes: ONNX Runtime's contrib op (domain `MS_DOMAIN`), inputs (A, B, a_scale,
b_scale, a_zero_point, b_zero_point, bias)."""

MS_DOMAIN = "com.microsoft"

B_ZERO_POINT = 5
"""`INT8_MATMUL`'s input index of the weight's zero point."""


def linear_matmuls(graph: Any) -> list[Any]:
    """MatMul nodes whose right input is a 2-D float initializer: the model's Linear layers (attention's
    score and context products multiply two activations and stay fp32)."""
    inits = {i.name: i for i in graph.initializer}
    return [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].data_type == 1]


ROLES = ("qkv", "attention-output", "ffn-in", "ffn-out", "other")
"""What a Linear MatMul does in a transformer layer (`matmul_roles`): a mixed-precision recipe keeps
whole roles in fp32."""


def matmul_roles(graph: Any) -> dict[str, str]:
    """Per Linear MatMul (by output name), its role, from the graph's structure alone: three MatMuls
    reading one tensor are Q, K and V; one reading a Gelu is the FFN output; one feeding a Gelu is the
    FFN input; one reading attention's context (a Reshape) is the attention output."""
    nodes = linear_matmuls(graph)
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in nodes:
        readers[n.input[0]] = readers.get(n.input[0], 0) + 1
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)

    def feeds_gelu(name: str, depth: int = 2) -> bool:
        """Whether `name` reaches a Gelu within `depth` nodes (the bias Add may sit between)."""
        return any("Gelu" in c.op_type or (depth > 1 and c.op_type == "Add" and feeds_gelu(c.output[0], depth - 1))
                   for c in consumers.get(name, []))

    roles = {}
    for n in nodes:
        source = producer.get(n.input[0])
        if readers[n.input[0]] == 3:
            role = "qkv"
        elif source is not None and "Gelu" in source.op_type:
            role = "ffn-out"
        elif feeds_gelu(n.output[0]):
            role = "ffn-in"
        elif source is not None and source.op_type in ("Reshape", "Transpose"):
            role = "attention-output"
        else:
            role = "other"
        roles[n.output[0]] = role
    return roles


Calibration = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]  # `calibrate`'s maxima, X^T X per weight


def activation_maxima(model_path: Path, feeds: Iterable[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per Linear MatMul input tensor (by name), max |x_j| per input channel over the `feeds` (fp32)."""
    return calibrate(model_path, feeds)[0]


def calibrate(model_path: Path, feeds: Iterable[dict[str, np.ndarray]],
              hessians: bool = False) -> Calibration:
    """One fp32 pass of the graph over the calibration `feeds`, padding rows left out: `activation_maxima`'s
    maxima and, with `hessians`, per Linear weight (by initializer name) X^T X of the inputs it multiplies
    (summed over the MatMuls sharing it, as ALBERT's layers do; float32, one matrix per distinct set of
    inputs): what `gptq.gptq_round` weighs rounding errors by."""
    import onnx  # heavy optional dependencies: only the export needs them
    import onnxruntime as ort

    model = onnx.load(str(model_path))
    nodes = linear_matmuls(model.graph)
    names = sorted({n.input[0] for n in nodes})
    known = {o.name for o in model.graph.output}
    for name in names:
        if name not in known:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    sources: dict[str, set[str]] = {}
    for node in nodes:
        sources.setdefault(node.input[1], set()).add(node.input[0])
    keys = {w: tuple(sorted(inputs)) for w, inputs in sources.items()}
    keys_reading = {name: {key for key in keys.values() if name in key} for name in names}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    maxima: dict[str, np.ndarray] = {}
    grams: dict[tuple[str, ...], np.ndarray] = {}
    for feed in feeds:
        mask = feed.get("attention_mask")
        for name, value in zip(names, session.run(names, feed), strict=True):
            rows = value.reshape(-1, value.shape[-1])
            if mask is not None and rows.shape[0] == mask.size:
                rows = rows[mask.reshape(-1) > 0]  # padding rows are not the model's inputs' statistics
            m = np.abs(rows).max(axis=0) if rows.size else np.zeros(value.shape[-1], np.float32)
            maxima[name] = m if name not in maxima else np.maximum(maxima[name], m)
            if hessians:
                gram = rows.T.astype(np.float32) @ rows.astype(np.float32)
                for key in keys_reading[name]:
                    grams[key] = gram if key not in grams else grams[key] + gram
    return maxima, {w: grams[key] for w, key in keys.items() if key in grams}


def _groups(nodes: Sequence[Any]) -> list[list[Any]]:
    """MatMuls connected by a shared input tensor or a shared weight (union-find)."""
    parent = list(range(len(nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for key in (f"x:{node.input[0]}", f"w:{node.input[1]}"):
            if key in first:
                parent[find(i)] = find(first[key])
            else:
                first[key] = i
    out: dict[int, list[Any]] = {}
    for i, node in enumerate(nodes):
        out.setdefault(find(i), []).append(node)
    return list(out.values())


def smooth_factors(act_max: np.ndarray, weights: Sequence[np.ndarray], alpha: float) -> np.ndarray:
    """SmoothQuant's s_j = max|X_j|^alpha / max|W_j|^(1-alpha), W_j over every weight [K, N] the
    activation meets (rows j of each)."""
    w_max = np.maximum(np.max([np.abs(w).max(axis=1) for w in weights], axis=0), 1e-5)
    s = np.power(np.maximum(act_max, 1e-5), alpha) / np.power(w_max, 1 - alpha)
    out: np.ndarray = np.maximum(s, 1e-5).astype(np.float32)
    return out


def quantize_columns(weight: np.ndarray, levels: int = INT8_MAX) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output column of a [K, N] weight, in [-levels, levels] (`INT8_MAX`, or
    `INT7_MAX` for 7-bit weights): (int8 [K, N], float32 scale [N])."""
    scale = np.maximum(np.abs(weight).max(axis=0) / levels, 1e-12).astype(np.float32)
    q = np.clip(np.rint(weight / scale[None, :]), -levels, levels).astype(np.int8)
    return q, scale


def rowwise_int8(src: Path, dst: Path, act_max: dict[str, np.ndarray] | None = None,
                 alpha: float | None = None, keep_fp32: Sequence[str] = (), unsigned_gelu: bool = False,
                 outliers: int = 0, weight_levels: int = INT8_MAX, activation_levels: int = INT8_MAX,
                 hessians: dict[str, np.ndarray] | None = None) -> dict[str, int]:
    """Write `dst`: `src` with every Linear MatMul in per-row int8 (SmoothQuant with `alpha` when
    `act_max`, from `activation_maxima`, is given), except those whose role (`matmul_roles`) is in
    `keep_fp32`. With `unsigned_gelu`, a MatMul reading a Gelu (the FFN output) quantizes x + 0.1701
    (GELU's output is >= -0.17) per row to uint8 0..255 (twice the resolution of symmetric int8) and
    subtracts the shift's product, a constant per column. With `outliers` (and `act_max`), the
    `outliers` input channels of each group with the largest calibrated max |x_j| leave the int8 product
    (LLM.int8()'s decomposition, with the channels fixed at export): they are gathered and multiplied by
    their fp32 weight rows, so they no longer set every row's scale. `weight_levels` and
    `activation_levels` (`INT8_MAX`, or `INT7_MAX`: 7 bits) bound the symmetric integer ranges; with 7-bit
    activations a row is stored as uint8 1..127 around 64 (a GELU row as 0..127). With `hessians`
    (`calibrate`), weights are rounded by `gptq.gptq_round`. Returns counts of what was rewritten."""
    import onnx  # heavy optional dependency: only the export needs it
    from onnx import helper, numpy_helper

    if alpha is not None and act_max is None:
        raise ValueError("SmoothQuant needs the calibration maxima")
    if outliers and act_max is None:
        raise ValueError("outlier channels are chosen from the calibration maxima")
    model = onnx.load(str(src))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    unknown = sorted(set(keep_fp32) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown MatMul roles {unknown}; known: {ROLES}")
    roles = matmul_roles(graph)
    nodes = [n for n in linear_matmuls(graph) if roles[n.output[0]] not in keep_fp32]
    new_inits: list[Any] = []
    consts: dict[str, str] = {}

    def const(name: str, value: np.ndarray) -> str:
        if name not in consts:
            new_inits.append(numpy_helper.from_array(value, name))
            consts[name] = name
        return name

    if activation_levels not in (INT8_MAX, INT7_MAX) or weight_levels not in (INT8_MAX, INT7_MAX):
        raise ValueError(f"levels are {INT8_MAX} (8 bits) or {INT7_MAX} (7 bits)")
    one = const("rowwise_one", np.array(1.0, np.float32))
    zp = const("rowwise_zp", np.array(activation_levels + 1, np.uint8))
    inv127 = const("rowwise_inv127", np.array(1.0 / activation_levels, np.float32))
    tiny = const("rowwise_tiny", np.array(1e-12, np.float32))
    inv255 = const("rowwise_inv255", np.array(1.0 / (2 * activation_levels + 1), np.float32))
    zero = const("rowwise_zero", np.array(0, np.uint8))
    last_axis = const("rowwise_last_axis", np.array([-1], np.int64))
    replaced: dict[str, list[Any]] = {}  # MatMul output -> the nodes replacing it
    quantized_weights: dict[str, tuple[str, str]] = {}
    row_quant: dict[str, tuple[str, str]] = {}  # input tensor -> (q, row scale)
    gathers: set[str] = set()  # input tensors whose outlier channels are gathered
    smoothed = 0
    for group in _groups(nodes):
        smooth: np.ndarray | None = None
        split: np.ndarray | None = None  # outlier channels kept fp32, ascending
        if act_max is not None:
            xs = [act_max[n.input[0]] for n in group if n.input[0] in act_max]
            weights = [numpy_helper.to_array(inits[n.input[1]]) for n in group]
            if xs:
                peak = np.max(xs, axis=0)
                if alpha is not None:
                    smooth = smooth_factors(peak, weights, alpha)
                    smoothed += 1
                kept = min(outliers, peak.size // OUTLIER_SHARE)
                if kept > 0:  # (a slice [-0:] would be every channel)
                    split = np.sort(np.argsort(peak)[-kept:]).astype(np.int64)
                    smooth = np.ones(peak.shape, np.float32) if smooth is None else smooth
        inverse = None if smooth is None else (1.0 / smooth).astype(np.float32)
        if inverse is not None and split is not None:
            inverse[split] = 0.0  # the outlier channels leave the int8 product, and so every row's scale
        for node in group:
            out: list[Any] = []
            x = node.input[0]
            shifted = unsigned_gelu and roles[node.output[0]] == "ffn-out"
            shift: np.ndarray | None = None
            if shifted:
                shift = np.full(inits[node.input[1]].dims[0], GELU_FLOOR, np.float32)
                if smooth is not None:
                    shift = (shift / smooth).astype(np.float32)
                if split is not None:
                    shift[split] = 0.0
            if x not in row_quant:
                p = f"rowwise_{len(row_quant)}"
                source = x
                if inverse is not None:
                    inv = const(f"{p}_inv_smooth", inverse)
                    out.append(helper.make_node("Mul", [x, inv], [f"{p}_xs"], name=f"{p}_smooth"))
                    source = f"{p}_xs"
            if x not in row_quant and shift is not None:
                out += [helper.make_node("Add", [source, const(f"{p}_shift", shift)], [f"{p}_xp"], name=f"{p}_shift"),
                        helper.make_node("ReduceMax", [f"{p}_xp", last_axis], [f"{p}_max"], name=f"{p}_rmax",
                                         keepdims=1),
                        helper.make_node("Mul", [f"{p}_max", inv255], [f"{p}_r0"], name=f"{p}_r0"),
                        helper.make_node("Max", [f"{p}_r0", tiny], [f"{p}_r"], name=f"{p}_r"),
                        helper.make_node("Div", [f"{p}_xp", f"{p}_r"], [f"{p}_xn"], name=f"{p}_xn"),
                        helper.make_node("QuantizeLinear", [f"{p}_xn", one, zero], [f"{p}_q"], name=f"{p}_q")]
                row_quant[x] = (f"{p}_q", f"{p}_r")
            elif x not in row_quant:
                out += [helper.make_node("Abs", [source], [f"{p}_abs"], name=f"{p}_abs"),
                        helper.make_node("ReduceMax", [f"{p}_abs", last_axis], [f"{p}_max"], name=f"{p}_rmax",
                                         keepdims=1),
                        helper.make_node("Mul", [f"{p}_max", inv127], [f"{p}_r0"], name=f"{p}_r0"),
                        helper.make_node("Max", [f"{p}_r0", tiny], [f"{p}_r"], name=f"{p}_r"),
                        helper.make_node("Div", [source, f"{p}_r"], [f"{p}_xn"], name=f"{p}_xn"),
                        helper.make_node("QuantizeLinear", [f"{p}_xn", one, zp], [f"{p}_q"], name=f"{p}_q")]
                row_quant[x] = (f"{p}_q", f"{p}_r")
            q, r = row_quant[x]
            w = node.input[1]
            if w not in quantized_weights:
                weight = numpy_helper.to_array(inits[w]).astype(np.float32)
                if smooth is not None:
                    weight = weight * smooth[:, None]
                if split is not None:
                    weight[split, :] = 0.0
                wq, ws = quantize_columns(weight, weight_levels)
                if hessians is not None and w in hessians:
                    h = hessians[w]
                    if inverse is not None:  # the int8 product's input is x * inverse
                        h = h * inverse[:, None] * inverse[None, :]
                    wq = gptq_round(weight, h, ws, weight_levels)
                quantized_weights[w] = (const(f"{w}_rowwise_q", wq), const(f"{w}_rowwise_scale", ws))
            wq_name, ws_name = quantized_weights[w]
            n = f"{node.name or node.output[0]}_rowwise"
            scaled = node.output[0] if shift is None and split is None else f"{n}_y"
            out += [helper.make_node(INT8_MATMUL, [q, wq_name, one, ws_name, zero if shift is not None else zp],
                                     [f"{n}_w"], name=f"{n}_mmi", domain=MS_DOMAIN),
                    helper.make_node("Mul", [f"{n}_w", r], [scaled], name=f"{n}_rscale")]
            if shift is not None:
                # (x + c) W' - c W': the shift's product with the int8 weight as dequantized, per column.
                wq = numpy_helper.to_array(inits[wq_name] if wq_name in inits else
                                           next(i for i in new_inits if i.name == wq_name)).astype(np.float32)
                scale = next(i for i in new_inits if i.name == ws_name)
                correction = (shift @ (wq * numpy_helper.to_array(scale)[None, :])).astype(np.float32)
                unshifted = node.output[0] if split is None else f"{n}_u"
                out.append(helper.make_node("Sub", [scaled, const(f"{n}_shift_product", correction)],
                                            [unshifted], name=f"{n}_unshift"))
                scaled = unshifted
            if split is not None:
                gathered = f"{x}_rowwise_outliers"
                if x not in gathers:  # MatMuls reading one tensor (Q, K, V) share its gathered channels
                    gathers.add(x)
                    out.append(helper.make_node("Gather", [x, const(f"{gathered}_idx", split)], [gathered],
                                                name=f"{gathered}_gather", axis=-1))
                rows = numpy_helper.to_array(inits[w]).astype(np.float32)[split, :]
                out += [helper.make_node("MatMul", [gathered, const(f"{w}_outlier_w", rows)], [f"{n}_o"],
                                         name=f"{n}_outlier_mm"),
                        helper.make_node("Add", [scaled, f"{n}_o"], [node.output[0]], name=f"{n}_outlier_add")]
            replaced[node.output[0]] = out
    rebuilt: list[Any] = []
    for node in graph.node:
        rebuilt.extend(replaced.get(node.output[0], [node]) if node.op_type == "MatMul" else [node])
    del graph.node[:]
    graph.node.extend(rebuilt)
    used = {i for node in graph.node for i in node.input}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep + [i for i in new_inits if i.name in used])
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    onnx.save(model, str(dst))
    return {"matmuls": len(nodes), "weights": len(quantized_weights), "row_quantizations": len(row_quant),
            "smoothed_groups": smoothed, "outlier_gathers": len(gathers)}


def int8_matmuls(graph: Any) -> list[Any]:
    """The graph's int8 products with a constant weight (input 1 an initializer): the rewritten Linears."""
    inits = {i.name for i in graph.initializer}
    return [n for n in graph.node if n.op_type == INT8_MATMUL and n.input[1] in inits]


def unsigned_weights(src: Path, dst: Path) -> int:
    """Write `dst`: `src` with every int8 product's constant int8 weight stored as uint8 (+128, zero point
    128). The integer products are the same, but ONNX Runtime runs them on its U8U8 kernels, which widen
    to 16 bits before multiplying, so nothing saturates where the CPU lacks int8 dot products. Returns
    the weights converted."""
    import onnx  # heavy optional dependency: only the export needs it
    from onnx import numpy_helper

    model = onnx.load(str(src))
    inits = {i.name: i for i in model.graph.initializer}
    zero_point = numpy_helper.from_array(np.array(ZERO_POINT, np.uint8), "rowwise_weight_zp_u8")
    done: set[str] = set()
    for node in int8_matmuls(model.graph):
        weight = inits[node.input[1]]
        if weight.name not in done and weight.data_type == onnx.TensorProto.INT8:
            shifted = (numpy_helper.to_array(weight).astype(np.int16) + ZERO_POINT).astype(np.uint8)
            weight.CopyFrom(numpy_helper.from_array(shifted, weight.name))
            done.add(weight.name)
        while len(node.input) <= B_ZERO_POINT:
            node.input.append("")
        node.input[B_ZERO_POINT] = zero_point.name
    model.graph.initializer.append(zero_point)
    onnx.save(model, str(dst))
    return len(done)
