"""vLLM serving LoRA versions (``trainer.lora``): each version a run-time adapter, several resident.

vLLM is started on the run's base model with ``--enable-lora --max-loras N --max-lora-rank R``
and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``vllm_launch.vllm_server`` with ``lora``).
**Stage** advances the island's shadow of the adapter with patches, as for any
view, and writes it as a peft adapter directory (``adapter_config.json`` with ``lora_alpha`` =
rank, the scaling being folded into ``lora_B``; ``adapter_model.safetensors``); **apply** loads it
through ``POST /v1/load_lora_adapter`` as ``v<version>`` and unloads (``/v1/unload_lora_adapter``)
the least recently used adapter beyond ``max_adapters`` that no request in flight runs on. The
base weights are never touched. A request runs at the newest resident version its bounds admit
(``"model": "v<version>"``) and is stamped with it; none: :class:`OutOfBounds` (the 409).

After a restart vLLM holds no adapter: :meth:`VLLMLoraBackend.recover` sees that in ``GET
/v1/models`` and loads the resident ones again before the next request.

Not covered: ``pause`` mode has nothing to pause (an adapter load never changes a running
request), and adapters of different ranks above ``--max-lora-rank`` are refused by vLLM.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import torch
from safetensors.torch import save_file

from policies.board import Board
from policies.errors import EngineError
from policies.serve.adapters import PEFT_PREFIX, AdapterLRU, adapter_config, adapter_name
from policies.serve.backends.base import EngineUnavailable
from policies.serve.backends.vllm import ADAPTER, VLLMBackend
from policies.serve.types import Generation, OutOfBounds, QuiesceMode
from policies.wire.lane import GenerateRequest, VersionBounds


def write_adapter(view: Mapping[str, torch.Tensor], out: Path) -> None:
    """``view`` (a LoRA version) as a peft adapter directory vLLM loads."""
    config = adapter_config(view)
    out.mkdir(parents=True, exist_ok=True)
    layers = sorted({name.rsplit(".", 1)[-1] for name in config.target_modules or ()})
    spec = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": layers,
        "base_model_name_or_path": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(spec))
    tensors = {f"{PEFT_PREFIX}{k}": t.contiguous() for k, t in view.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"))


class VLLMLoraBackend(VLLMBackend):
    """vLLM with LoRA versions as resident adapters (module docstring)."""

    def __init__(self, url: str, *, work_dir: Path, max_adapters: int, **kw: Any) -> None:
        super().__init__(url, work_dir=work_dir, **kw)
        self.lru = AdapterLRU(max_adapters)
        self._running: Counter[int] = Counter()  # requests in flight per version

    def _dir(self, version: int) -> Path:
        return self.work_dir / f"lora-{version:08d}"

    def resident_versions(self) -> list[int]:
        return self.lru.versions()

    async def stage(self, board: Board, version: int) -> None:
        await anyio.to_thread.run_sync(self.shadow.stage, board, version)
        _, view = self.shadow.take(version)
        await anyio.to_thread.run_sync(write_adapter, view, self._dir(version))

    async def _load(self, version: int) -> None:
        body = {"lora_name": adapter_name(version), "lora_path": str(self._dir(version))}
        await self.call("/v1/load_lora_adapter", body)

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        staged, _ = self.shadow.take(version)
        try:
            await self._load(version)
        except EngineError:
            shutil.rmtree(self._dir(version), ignore_errors=True)
            raise
        in_use = {v for v, n in self._running.items() if n}
        for victim in self.lru.add(version, in_use):
            await self.call("/v1/unload_lora_adapter", {"lora_name": adapter_name(victim)})
            shutil.rmtree(self._dir(victim), ignore_errors=True)
        self.shadow.activated(staged)

    async def recover(self) -> None:
        """Load the resident adapters again if vLLM restarted without them (asked at most once
        a second while nothing failed)."""
        resident = self.lru.versions()
        if not resident or not self._status_due():
            return
        try:
            out = await self.call("/v1/models")
        except EngineUnavailable:
            self.lost = True
            raise
        models = out.get("data") if isinstance(out, dict) else None
        served = {m.get("id") for m in models if isinstance(m, dict)} if models else set()
        missing = [v for v in resident if adapter_name(v) not in served]
        for version in missing:
            await self._load(version)
        self.lost = False

    async def generate(self, req: GenerateRequest) -> Generation:
        version = self.lru.pick(req.policy_version)
        if version is None:
            raise OutOfBounds(self.version)
        self._running[version] += 1
        token = ADAPTER.set(adapter_name(version))
        try:
            # admitted here, at a resident version: the newest one need not fit the bounds
            gen = await super().generate(req.model_copy(update={"policy_version": VersionBounds()}))
        finally:
            ADAPTER.reset(token)
            self._running[version] -= 1
        return Generation(gen.choices, version, version)
