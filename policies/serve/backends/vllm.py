"""vLLM behind the sidecar: ``/v1/completions`` with token ids, weights patched in place by RPC.

Generation: ``POST /v1/completions`` with ``prompt`` = token ids, ``logprobs: 0`` and
``return_tokens_as_token_ids: true``; token ids come from ``choices[0].token_ids`` when the
server returns them (``return_token_ids``, vLLM ≥ 0.10.2) or else from the ``"token_id:N"``
strings of ``logprobs.tokens``; log probs from ``logprobs.token_logprobs``. Log probs are of the
distribution sampled only with ``--logprobs-mode processed_logprobs``.

Activation: the server is started with ``--worker-extension-cls
policies.serve.backends.vllm_worker.SprawlWorkerExtension`` and ``VLLM_SERVER_DEV_MODE=1``.
**stage** reads the version's manifest (the worker verifies the tensors when it loads them);
**apply** calls ``POST /collective_rpc`` ``{"method": "sprawl_load_version", "args": [board_url,
run, version]}`` — every worker loads the verified view from the board and copies it into its live
parameters through the model's own ``load_weights`` — then ``POST /reset_prefix_cache`` so no
KV block computed with the old weights is reused. vLLM runs RPCs between engine steps, so in
``"pause"`` mode in-flight requests continue on the new weights.
"""

from __future__ import annotations

import anyio

from policies.board import Board
from policies.serve.backends.base import EngineUnavailable, HttpBackend
from policies.serve.decode import QuiesceMode
from policies.wire.lane import FinishReason, GenerateRequest

RPC_METHOD = "sprawl_load_version"


def token_ids_of(choice: dict[str, object]) -> list[int]:
    """Token ids of a completions choice: ``token_ids``, else ``"token_id:N"`` strings."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(i) for i in ids]
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list):
        raise EngineUnavailable("completion choice has neither token_ids nor logprobs.tokens")
    out = []
    for t in tokens:
        if not (isinstance(t, str) and t.startswith("token_id:")):
            raise EngineUnavailable(f"token {t!r} is not a token id (return_tokens_as_token_ids)")
        out.append(int(t.removeprefix("token_id:")))
    return out


class VLLMBackend(HttpBackend):
    kind = "vllm"

    def __init__(self, url: str, *, board_url: str, **kw: object) -> None:
        super().__init__(url, **kw)  # type: ignore[arg-type]
        self._board_url = board_url
        self._run: str | None = None

    async def generate_one(
        self, req: GenerateRequest, seed: int | None
    ) -> tuple[list[int], list[float], FinishReason]:
        body: dict[str, object] = {
            "model": self.name,
            "prompt": req.prompt_token_ids,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stop_token_ids": req.stop_token_ids,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if req.top_k > 0:
            body["top_k"] = req.top_k
        if seed is not None:
            body["seed"] = seed
        out = await self.call("/v1/completions", body)
        try:
            choice = out["choices"][0]
            tokens = token_ids_of(choice)
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            reason = choice.get("finish_reason")
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineUnavailable(f"vllm /v1/completions answer lacks {exc}") from None
        if len(tokens) != len(logprobs):
            raise EngineUnavailable("vllm returned a log prob count that differs from the tokens")
        finish: FinishReason = reason if reason in ("stop", "length") else "abort"
        return tokens, logprobs, finish

    async def stage(self, board: Board, version: int) -> None:
        await anyio.to_thread.run_sync(board.manifest, version)
        self._run = board.run

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        out = await self.call(
            "/collective_rpc",
            {"method": RPC_METHOD, "args": [self._board_url, self._run or "", str(version)]},
        )
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineUnavailable(f"vllm collective_rpc gave no results: {out!r}"[:300])
        digests = {str(r) for r in results}
        if len(digests) != 1:
            raise EngineUnavailable(f"vllm workers disagree after loading {version}: {digests}")
        await self.call("/reset_prefix_cache", {})
