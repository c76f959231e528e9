"""The trainer's configuration: the ``[trainer]`` section of a run config, as the trainer takes it.

The orchestrator's config tree (:mod:`orchestrator.config`) holds this model as its ``trainer``
field, and :class:`~policies.train.trainer.Trainer` takes it as it is: one source of truth. No
torch here, so parsing a config stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainerConfig(BaseModel):
    """The ``[trainer]`` section: how the reference trainer (or an external one) steps."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Literal["in_process", "external"] = "in_process"
    """``in_process``: the reference trainer in this process. ``external``: any trainer in
    another process, through batch files and the board (``policies/wire/batches.py``)."""
    batch_dir: Path | None = None
    """Where batch files go in ``external`` mode; default ``<run dir>/batches``."""
    max_steps: int = Field(default=4, ge=1)
    """Optimizer steps (= versions published after version 0)."""
    lr: float = Field(default=2e-4, gt=0, le=1)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trainer's master weights."""
    served_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the view engines serve (what the board publishes)."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO clip range."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of the trainer."""
    kl_coef: float = Field(default=0.0, ge=0, le=10)
    """Weight of the KL(π_θ ‖ π_ref) penalty against the frozen version 0 (0: off, no reference
    model is loaded)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman 2020): ``k3`` is unbiased and non-negative."""
    entropy_coef: float = Field(default=0.0, ge=0, le=1)
    """Weight of the entropy bonus (subtracted from the loss; 0: off, entropy is still logged)."""
    checkpoint: bool = True
    """Checkpoint model + optimizer + RNG after every step into ``<run dir>/trainer/ckpt``."""

    @model_validator(mode="before")
    @classmethod
    def _loss_agg_lives_in_staleness(cls, data: Any) -> Any:
        if isinstance(data, dict) and "loss_agg" in data:
            msg = (
                "loss_agg: moved to the [staleness] table (staleness.loss_agg), next to the "
                "normalizer it works with"
            )
            raise ValueError(msg)
        return data
