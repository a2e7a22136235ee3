"""Export the encoder's last layer for the first token only.

Detoxify's heads read one token of the last layer: BERT's and ALBERT's poolers and RoBERTa's
classification head all take `hidden_states[:, 0]`. In the last layer every other token's attention
output projection, feed-forward and LayerNorms are computed and thrown away. `first_token_only` makes the
exported graph skip that work: while it is active, the last layer's attention block projects token 0's
context alone and passes token 0 alone on to the feed-forward. The scores are the same computation (the
export check and the fidelity gate hold the graph to torch); the saving is three quarters of one layer's
matrix products: about an eighth of a 6-layer MiniLM, a sixteenth of a 12-layer ALBERT-base.

It finds the layers by shape, not by class name: the innermost modules in a `ModuleList` that hold
Linears named `query`, `key` and `value` (BERT, RoBERTa, XLM-R and ALBERT in transformers); in each, the
attention block's one other Linear (its output projection) and its one LayerNorm. It counts the layers'
calls, since ALBERT runs one shared layer `num_hidden_layers` times.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PROJECTIONS = ("query", "key", "value")
"""Names of the attention projections the layer search looks for."""


class FirstTokenError(RuntimeError):
    """The model's layers were not found, or not run as the config says: export it whole instead."""


def encoder_layers(model: Any) -> list[Any]:
    """The modules of `model` that are one encoder layer each: in a `ModuleList`, holding Linears named
    `query`, `key` and `value`, and holding no such layer themselves."""
    import torch  # heavy optional dependency: only the export command needs it

    def has_projections(module: Any) -> bool:
        names = {name.rsplit(".", 1)[-1] for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
        return set(PROJECTIONS) <= names

    found = [layer for modules in model.modules() if isinstance(modules, torch.nn.ModuleList)
             for layer in modules if has_projections(layer)]
    return [layer for layer in found if not any(other is not layer and any(m is other for m in layer.modules())
                                                for other in found)]


def attention_output(layer: Any) -> tuple[Any, Any]:
    """The layer's attention output projection and the LayerNorm after it: the one Linear under
    `attention` that is not a query, key or value projection, and the one LayerNorm there."""
    import torch  # heavy optional dependency: only the export command needs it

    under = [(name.rsplit(".", 1)[-1], m) for name, m in layer.named_modules() if name.startswith("attention.")]
    linears = [m for leaf, m in under if isinstance(m, torch.nn.Linear) and leaf not in PROJECTIONS]
    norms = [m for _, m in under if isinstance(m, torch.nn.LayerNorm)]
    if len(linears) != 1 or len(norms) != 1:
        raise FirstTokenError(f"{type(layer).__name__}: {len(linears)} attention output projections and "
                              f"{len(norms)} LayerNorms, expected one each")
    return linears[0], norms[0]


@contextmanager
def first_token_only(model: Any) -> Iterator[None]:
    """While active, `model`'s forward computes its last encoder layer past the attention scores for
    token 0 alone: the last layer's other positions are absent from its output, so only a head that
    reads token 0 gives the same scores. FirstTokenError if the layers are not found or not run as the
    config says."""
    layers = encoder_layers(model)
    if not layers:
        raise FirstTokenError(f"no encoder layers with {'/'.join(PROJECTIONS)} projections in {type(model).__name__}")
    outputs = [attention_output(layer) for layer in layers]
    last_call = int(model.config.num_hidden_layers) - 1
    state = {"calls": 0, "active": False}
    handles: list[Any] = []

    def start(_module: Any, _args: Any) -> None:
        state["calls"], state["active"] = 0, False

    def finish(_module: Any, _args: Any, _output: Any) -> None:
        if state["calls"] != last_call + 1:
            raise FirstTokenError(f"{state['calls']} encoder layer calls, the config says {last_call + 1}")

    def enter(_module: Any, _args: Any) -> None:
        state["active"] = state["calls"] == last_call
        state["calls"] += 1

    def leave(_module: Any, _args: Any, _output: Any) -> None:
        state["active"] = False

    def first_input(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        return (args[0][:, :1], *args[1:]) if state["active"] else None

    def first_output(_module: Any, _args: Any, output: Any) -> Any:
        return output[:, :1] if state["active"] else None

    try:
        handles.append(model.register_forward_pre_hook(start))
        handles.append(model.register_forward_hook(finish))
        for layer, (projection, norm) in zip(layers, outputs, strict=True):
            handles.append(layer.register_forward_pre_hook(enter))
            handles.append(layer.register_forward_hook(leave))
            # Token 0's context alone is projected; the residual add broadcasts it over every token, and
            # the LayerNorm's output is cut to token 0, which is exactly token 0's row of the full layer.
            handles.append(projection.register_forward_pre_hook(first_input))
            handles.append(norm.register_forward_hook(first_output))
        yield
    finally:
        for handle in handles:
            handle.remove()
