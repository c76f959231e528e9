"""SGLang behind the sidecar: native ``/generate`` with token ids, weights reloaded from disk.

Generation: ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``,
``temperature``, ``top_p``, ``top_k`` (-1 = off), ``stop_token_ids``, ``sampling_seed``) and
``return_logprob: true``; tokens and log probs come from ``meta_info.output_token_logprobs``
(``[logprob, token_id, text]`` triples), the finish reason from ``meta_info.finish_reason.type``.
Log probs are of the distribution sampled only when the server runs with
``--enable-return-processed-logprobs`` (recent SGLang); otherwise they are the raw model's.

Activation: **stage** materializes the version as an HF checkpoint directory
(``Board.materialize``, which verifies every checksum) under ``materialize_dir`` — a path the
SGLang server can read; **apply** calls ``POST /update_weights_from_disk`` with ``model_path`` and
``weight_version``. In ``"pause"`` mode it is wrapped in ``POST /pause_generation``
``{"mode": "retract"}`` (running requests go back to the queue and their KV cache is recomputed
with the new weights after ``POST /continue_generation``); in ``"wait"`` mode the sidecar drains
first. The previous version's directory is removed after a successful switch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio

from policies.board import Board
from policies.serve.backends.base import EngineUnavailable, HttpBackend
from policies.serve.decode import QuiesceMode
from policies.wire.lane import FinishReason, GenerateRequest


class SGLangBackend(HttpBackend):
    kind = "sglang"

    def __init__(self, url: str, *, materialize_dir: Path, **kw: object) -> None:
        super().__init__(url, **kw)  # type: ignore[arg-type]
        self.materialize_dir = materialize_dir
        self._staged: Path | None = None
        self._live: Path | None = None

    async def generate_one(
        self, req: GenerateRequest, seed: int | None
    ) -> tuple[list[int], list[float], FinishReason]:
        params: dict[str, object] = {
            "max_new_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k if req.top_k > 0 else -1,
            "stop_token_ids": req.stop_token_ids,
            "skip_special_tokens": False,
        }
        if seed is not None:
            params["sampling_seed"] = seed
        out = await self.call(
            "/generate",
            {"input_ids": req.prompt_token_ids, "sampling_params": params, "return_logprob": True},
        )
        if isinstance(out, list):
            out = out[0]
        try:
            meta = out["meta_info"]
            triples = meta["output_token_logprobs"]
            tokens = [int(t[1]) for t in triples]
            logprobs = [float(t[0]) for t in triples]
            kind = (meta.get("finish_reason") or {}).get("type", "abort")
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineUnavailable(f"sglang /generate answer lacks {exc}") from None
        finish: FinishReason = kind if kind in ("stop", "length") else "abort"
        return tokens, logprobs, finish

    async def stage(self, board: Board, version: int) -> None:
        out = self.materialize_dir / f"v{version:08d}"
        await anyio.to_thread.run_sync(board.materialize, version, out)
        self._staged = out

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        staged = self._staged
        if staged is None:
            raise EngineUnavailable(f"version {version} was not staged")
        if mode == "pause":
            await self.call("/pause_generation", {"mode": "retract"})
        try:
            out = await self.call(
                "/update_weights_from_disk",
                {"model_path": str(staged), "weight_version": str(version)},
            )
        finally:
            if mode == "pause":
                await self.call("/continue_generation", {})
        if not isinstance(out, dict) or not out.get("success", False):
            message = out.get("message") if isinstance(out, dict) else out
            raise EngineUnavailable(f"sglang refused version {version}: {message}")
        old, self._live, self._staged = self._live, staged, None
        if old is not None and old != staged:
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(old, ignore_errors=True))
