"""The reference engine's model runner: any HF causal LM, token ids in, tokens + log probs out.

Guarantees:

- each returned log prob is the log probability of the sampled token under the distribution that
  was actually sampled (logits / temperature, then top-k, then top-p, renormalized); greedy
  decoding (temperature 0) reports the log prob under the untempered distribution;
- ``seed`` makes a call reproducible on the same device and weights (choice ``i`` uses
  ``seed + i``);
- a stop token (``stop_token_ids`` or the model's EOS) ends a choice and is included in its
  ``token_ids``, so multi-turn prompts can be continued token-exactly;
- concurrent requests are batched by :class:`policies.serve.decode.DecodeBatcher` (they join and
  leave at decode-step boundaries); a request is validated here, before it is queued, so a bad
  request never reaches the batch;
- :meth:`Engine.activate` replaces the weights in place, bit for bit, from a served view, at a
  decode-step boundary (``mode="pause"`` holds in-flight generations there, ``mode="wait"``
  drains them first), and sets the engine's ``version`` in the same critical section, so every
  request's version stamp names the weights that actually produced its tokens;
- for an MoE model each choice carries ``routed_experts`` (the experts every forwarded position
  was routed to, vLLM's shape: :mod:`policies.serve.decode`);
- :meth:`Engine.load_adapter` serves LoRA versions: each is an adapter beside the base weights
  (never touched), several resident at once (``max_adapters``, least recently used evicted), and a
  request runs through the newest resident one its bounds admit (:mod:`policies.serve.adapters`).

Not covered here: version bookkeeping against the board (the sidecar owns it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from policies.errors import BadRequest
from policies.serve.adapters import ResidentAdapters, adapter_config
from policies.serve.decode import DecodeBatcher
from policies.serve.types import Generation, QuiesceMode, check_routing_start

if TYPE_CHECKING:
    from peft import LoraConfig
from policies.wire.lane import GenerateChoice, GenerateRequest

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Activation:
    """How long an activation took: reaching a step boundary, then holding generation there.

    In ``"pause"`` mode ``wait_s`` is at most one decode step; in ``"wait"`` mode it includes
    draining in-flight requests. ``held_s`` is the engine pause proper: no token is generated.
    """

    wait_s: float
    held_s: float


class Engine:
    """Holds one model, its tokenizer and its batch scheduler."""

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        max_rows: int = 64,
        base_weights: Path | None = None,
        max_adapters: int = 4,
    ):
        """``base_weights``: a model directory whose weights to start from (what LoRA versions
        adapt; :meth:`load_adapter`); unset, the weights are random until the first
        :meth:`activate`. ``max_adapters``: LoRA versions resident at once."""
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        self.dtype = dtype or torch.float32
        if base_weights is None:
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)  # type: ignore[no-untyped-call]
        else:
            self.model = AutoModelForCausalLM.from_pretrained(base_weights, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.max_context = int(getattr(self.config, "max_position_embeddings", 2048))
        self.eos_ids = set(_eos_ids(model_dir, self.tokenizer))
        self.name = model_dir.name
        self.batcher = DecodeBatcher(self.model, device=self.device, max_rows=max_rows)
        self.adapters = ResidentAdapters(self.model, max_resident=max_adapters)

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """The live parameters by served-view name (tied aliases left out); patch them in place."""
        params = self.model.state_dict(keep_vars=True)
        return {k: v.data for k, v in params.items() if not self._tied(k)}

    def activate(
        self,
        view: Mapping[str, torch.Tensor],
        *,
        version: int,
        mode: QuiesceMode = "wait",
        only: Collection[str] | None = None,
    ) -> Activation:
        """Copy a served view into the live parameters, bit for bit, and serve ``version``.

        ``only`` limits the copy to those tensors (the ones that changed since the live
        version); the view must then hold at least those, else every live tensor. The view is
        checked before the model is touched, so a bad view changes nothing.
        """
        if self.batcher.adapters is not None:
            raise BadRequest(
                f"version {version} is a full view; this engine serves LoRA versions", "view"
            )
        params = self.live_tensors()
        missing = [name for name in (params if only is None else only) if name not in view]
        if missing:
            raise BadRequest(f"view lacks tensors the model needs: {missing[:3]}", "view")
        for name, src in view.items():
            dst = params.get(name)
            if dst is None:
                if self._tied(name):
                    continue
                raise BadRequest(f"view has a tensor the model does not: {name}", "view")
            if dst.shape != src.shape:
                raise BadRequest(f"{name}: shape {tuple(src.shape)} != {tuple(dst.shape)}", "view")

        def copy(live: dict[str, torch.Tensor]) -> None:
            for name, dst in live.items():
                if only is None or name in only:
                    dst.copy_(view[name].to(device=dst.device, dtype=dst.dtype))

        return self.apply(copy, version=version, mode=mode)

    def load_adapter(
        self, view: Mapping[str, torch.Tensor], *, version: int, mode: QuiesceMode = "pause"
    ) -> Activation:
        """Make the LoRA version ``view`` (its adapter) resident beside the base weights, which
        stay untouched, and serve ``version`` as the newest; requests keep running on the
        adapters they picked. Evicts the least recently used adapter beyond ``max_adapters``
        (draining in-flight rows first, ``"wait"``, only when each candidate is in use, and on
        the first adapter). A view that is not an adapter of this model changes nothing."""
        config = adapter_config(view)
        adapters = self.adapters
        first = self.batcher.adapters is None
        mode = "wait" if first else mode
        with self.batcher.quiesce(mode) as waited, torch.no_grad():
            t0 = time.perf_counter()
            if first or adapters.evictable(self.batcher.adapters_in_use()):
                self._load_adapter(view, version, config)
                return Activation(wait_s=waited, held_s=time.perf_counter() - t0)
        with self.batcher.quiesce("wait") as waited, torch.no_grad():
            t0 = time.perf_counter()
            self._load_adapter(view, version, config)
            return Activation(wait_s=waited, held_s=time.perf_counter() - t0)

    def _load_adapter(
        self, view: Mapping[str, torch.Tensor], version: int, config: LoraConfig
    ) -> None:
        """At a step boundary: load, evict, and serve through the adapters from now on."""
        evicted = self.adapters.load(version, view, config, self.batcher.adapters_in_use())
        self.batcher.model = self.adapters.model or self.batcher.model
        self.batcher.adapters = self.adapters
        self.batcher.version = version
        log.info(
            "adapter_loaded", version=version, evicted=evicted, resident=self.adapters.versions()
        )

    def apply(
        self,
        fn: Callable[[dict[str, torch.Tensor]], object],
        *,
        version: int,
        mode: QuiesceMode = "wait",
    ) -> Activation:
        """Run ``fn(live tensors)`` at a step boundary, then serve ``version``.

        ``fn`` patches the tensors in place (e.g. ``policies.codec.apply_patch``); if it raises,
        the version is not switched and the exception propagates.
        """
        live = self.live_tensors()
        with self.batcher.quiesce(mode) as waited, torch.no_grad():
            t0 = time.perf_counter()
            fn(live)
            self.batcher.version = version
            held = time.perf_counter() - t0
        return Activation(wait_s=waited, held_s=held)

    def _tied(self, name: str) -> bool:
        tied = getattr(self.model, "_tied_weights_keys", None) or {}
        return name in tied

    @property
    def version(self) -> int | None:
        """The policy version whose weights are live (``None`` before the first activation)."""
        return self.batcher.version

    def validate(self, req: GenerateRequest) -> tuple[int, frozenset[int]]:
        """Check ``req`` against the model; return its token budget and its stop tokens."""
        vocab = int(self.config.vocab_size)
        for field, ids in (
            ("prompt_token_ids", req.prompt_token_ids),
            ("stop_token_ids", req.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"token id {bad[0]} outside the vocabulary [0, {vocab})", field)
        check_routing_start(req)
        room = self.max_context - len(req.prompt_token_ids)
        if room <= 0:
            raise BadRequest(
                f"prompt has {len(req.prompt_token_ids)} tokens; the model's context is "
                f"{self.max_context}",
                "prompt_token_ids",
            )
        return min(req.max_tokens, room), frozenset(self.eos_ids | set(req.stop_token_ids))

    async def agenerate(self, req: GenerateRequest) -> Generation:
        """Sample ``req.n`` continuations in the shared batch (cancelling aborts them)."""
        max_tokens, stops = self.validate(req)
        return await asyncio.wrap_future(self.batcher.submit(req, max_tokens, stops))

    def generate(self, req: GenerateRequest) -> list[GenerateChoice]:
        """Blocking form of :meth:`agenerate` (for scripts and worker threads)."""
        max_tokens, stops = self.validate(req)
        return self.batcher.submit(req, max_tokens, stops).result().choices

    def close(self) -> None:
        """Stop the batch thread; queued and running requests fail with ``EngineError``."""
        self.batcher.close()


def _eos_ids(model_dir: Path, tok: PreTrainedTokenizerBase) -> list[int]:
    ids: list[int] = []
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    return ids
