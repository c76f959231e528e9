"""For live vLLM tests: sprawl's own model in a shape vLLM's CPU attention serves (head_dim ≥ 32),
the prompts they ask and the trainer batches that make their versions."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM

from policies.train.samples import TrainSample

PROMPTS = [[1, 17, 300, 42, 99, 7], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 400, 401, 2, 1, 33]]


def samples(seed: int) -> list[TrainSample]:
    """Four scored samples of 12 random tokens (the last 6 trained on): one trainer step."""
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        ids = [rng.randrange(3, 2000) for _ in range(12)]
        out.append(TrainSample(ids, [False] * 6 + [True] * 6, [0.0] * 6 + [-7.0] * 6, rng.random()))
    return out


def head_dim_32(tiny: Path, out: Path) -> Path:
    """The tiny model's tokenizer and shape with 2 attention heads of 32 (vLLM's CPU attention
    needs head_dim ≥ 32), random weights, float32 safetensors."""
    config = AutoConfig.from_pretrained(tiny)
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny / name).exists():
            (out / name).write_bytes((tiny / name).read_bytes())
    return out
