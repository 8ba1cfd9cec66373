"""Where keras-hub's Transformer blocks keep the sub-layers tnt splits, by block class.

A block is Python code (its ``call``): the plan and the block shard reach its attention
and feed-forward layers through these attribute names, which differ between keras-hub's
model families. Gated blocks (Llama, Gemma) have two column-split feed-forward layers
whose outputs meet elementwise (gate times up) before the row-split one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockParts:
    """The attribute names of a block's attention, its column-split and row-split FFN layers."""

    attention: str
    columns: tuple[str, ...]
    row: str
    attention_path: str  # the attention's variable path inside the block ("self_attention/...")
    gated: bool


_PARTS = {
    "TransformerEncoder": BlockParts("_self_attention_layer", ("_feedforward_intermediate_dense",),
                                     "_feedforward_output_dense", "self_attention_layer", False),
    "TransformerDecoder": BlockParts("_self_attention_layer", ("_feedforward_intermediate_dense",),
                                     "_feedforward_output_dense", "self_attention", False),
    "LlamaTransformerDecoder": BlockParts("_self_attention_layer",
                                          ("_feedforward_intermediate_dense", "_feedforward_gate_dense"),
                                          "_feedforward_output_dense", "self_attention", True),
    "GemmaDecoderBlock": BlockParts("attention", ("gating_ffw", "gating_ffw_2"), "ffw_linear", "attention", True),
}


def block_parts(layer) -> BlockParts | None:
    """The parts of a keras-hub block of exactly one of the classes above (a subclass's
    call may differ), else None."""
    cls = type(layer)
    return _PARTS.get(cls.__name__) if cls.__module__.startswith("keras_hub.") else None


__all__ = ["BlockParts", "block_parts"]
