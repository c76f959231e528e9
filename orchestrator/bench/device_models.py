"""The models of ``orchestrate bench device``: sprawl's own sizes, and wider Qwen2 shapes of them.

A name of :data:`MODELS` is a size of :func:`policies.model.build.init_model` (its tokenizer,
chat template and generation config) and, for a wider shape, the Qwen2 config fields that differ:
the model directory is built as that size, then its weights are replaced by a random init of the
wider shape (``seed`` fixed, float32, tied embeddings as every sprawl model). ``qwen2-1b`` is
~0.98 B parameters (2 GB in bf16), the Llama-3.2-1B / Qwen2 proportions on sprawl's 4 096-token
vocabulary; ``tiny-wide`` is its stand-in on a CPU. Models are built once per ``--work`` dir.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from policies.model.build import init_model
from policies.model.sizes import ModelSize

MODELS: dict[str, tuple[ModelSize, dict[str, int]]] = {
    "tiny": ("tiny", {}),
    "small": ("small", {}),
    "medium": ("medium", {}),
    "tiny-wide": (
        "tiny",
        {
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    ),
    "qwen2-1b": (
        "medium",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
        },
    ),
}


def model_dir(work: Path, name: str, seed: int = 0) -> Path:
    """The directory of model ``name`` under ``work/models``, built there if missing."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    out, built = work / "models" / name, work / "models" / f"{name}.built"
    if built.is_file():
        return out
    size, shape = MODELS[name]
    init_model(out, size, seed=seed)
    if shape:
        built_as = AutoConfig.from_pretrained(out)
        values = {k: v for k, v in built_as.to_dict().items() if k != "layer_types"}  # per layer
        values.update(shape, max_window_layers=shape["num_hidden_layers"])
        config = type(built_as).from_dict(values)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=torch.float32
            )
        bars_were_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        try:
            model.save_pretrained(out, max_shard_size="100GB")  # one model.safetensors
        finally:
            if bars_were_on:
                hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    built.write_text(name + "\n")  # written last: a half-built directory is built again
    return out


def parameters(path: Path) -> int:
    """Parameters of the model at ``path`` (tied ones once), from its config."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return sum(p.numel() for p in model.parameters())  # tied parameters are listed once
