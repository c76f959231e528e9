"""sprawl's own model in a shape vLLM's CPU attention serves (head_dim ≥ 32), for live tests."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM


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
