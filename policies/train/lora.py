"""LoRA versions: the trainer's adapter and its served view.

With ``trainer.lora`` set the trainer injects a fresh ``peft`` LoRA adapter into the model
(:func:`with_lora`) and trains only the adapter; a version's served view is the adapter's tensors
(:func:`adapter_view`), published through the board like any view, and read back by the engines'
adapter support (:mod:`policies.serve.adapters`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from policies.errors import AdapterError
from policies.train.config import LoraConfig


def with_lora(model: PreTrainedModel, lora: LoraConfig) -> PreTrainedModel:
    """``model`` with a fresh LoRA adapter (``peft``; ``lora_B`` zero, so it computes what the
    base does) on every ``lora.target_modules`` layer; only the adapter is trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    spec = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
    )
    try:
        inject_adapter_in_model(spec, model)  # in place
    except ValueError as exc:  # peft names the modules it did not find
        raise AdapterError(f"trainer.lora.target_modules: {exc}") from None
    return model


def adapter_view(
    model: torch.nn.Module, lora: LoraConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A LoRA version's served view: the adapter's tensors under peft's names
    (``….q_proj.lora_A.weight``), cast to ``dtype``, with the scaling ``alpha / rank`` folded
    into every ``lora_B`` so the tensors alone define the adapter (rank from their shapes, the
    adapted layers from their names; ``policies.serve.adapters``)."""
    from peft import get_peft_model_state_dict

    scale = lora.alpha / lora.rank
    out: dict[str, torch.Tensor] = {}
    for name, t in get_peft_model_state_dict(model).items():
        t = t.detach()
        if name.endswith(".lora_B.weight"):
            t = t * scale
        out[name] = t.to(dtype=dtype, copy=True)
    return out
