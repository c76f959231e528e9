"""The sizes of sprawl's own model: the shape of each, and which of them are mixtures of experts.

No I/O: :data:`SPECS` maps every :data:`ModelSize` to its :class:`ModelSpec`, which
:mod:`policies.model.tokenizer` (vocabulary size, context length, how much corpus to train on) and
:mod:`policies.model.build` (the network's shape) read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ModelSize = Literal["tiny", "small", "medium", "large", "tiny-moe"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one model size; ``vocab_size`` counts the special and tool tokens; ``experts``
    > 0 makes it a Qwen3-MoE model, ``experts_per_token`` of them routed per token, each an MLP
    of ``expert_intermediate_size``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    corpus_docs: int
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0


SPECS: dict[ModelSize, ModelSpec] = {
    # Small enough that an RL demo runs on 2 CPU cores.
    "tiny": ModelSpec(2048, 64, 2, 4, 2, 176, 2048, corpus_docs=20_000),
    "small": ModelSpec(4096, 256, 4, 8, 4, 688, 2048, corpus_docs=40_000),
    # ~100 M parameters (0.2 GB served in bf16): what grows with the model, such as an engine's
    # reload of a version (``bench sync --engine``), measured at a size where it shows.
    "medium": ModelSpec(4096, 1024, 8, 16, 8, 2816, 2048, corpus_docs=40_000),
    # ~0.5 B parameters (1 GB in bf16): whether a version's cost grows with the patch or the model.
    "large": ModelSpec(4096, 1536, 20, 12, 4, 4096, 2048, corpus_docs=40_000),
    # The tiny model's tokenizer and attention, with a mixture of experts for its MLPs.
    "tiny-moe": ModelSpec(
        2048,
        64,
        2,
        4,
        2,
        176,
        2048,
        corpus_docs=20_000,
        experts=8,
        experts_per_token=2,
        expert_intermediate_size=64,
    ),
}
