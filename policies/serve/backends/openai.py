"""A frozen OpenAI-compatible endpoint behind the sidecar (a llama.cpp server, a hosted API).

It serves one fixed, declared version (``--version``); the sidecar never stages or activates
anything, and requests whose bounds exclude that version get 409.

Generation: ``POST /v1/completions`` with ``prompt`` = token ids, ``logprobs: 1``, ``seed``,
``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (when > 0); the answer is translated to
the lane from whichever shape the server uses:

- ``choices[0].token_ids`` (vLLM-style extension) or ``"token_id:N"`` token strings;
- llama.cpp: ``choices[0].logprobs.content`` entries ``{"id", "token", "logprob", ...}``;
- plain OpenAI: ``logprobs.tokens`` strings + ``token_logprobs``, mapped to ids with the board's
  tokenizer one piece at a time — exact only when every piece is one vocabulary token, and
  refused (503) otherwise rather than guessed.

Stop token ids are sent as ``stop_token_ids`` (vLLM) only when given; llama.cpp and hosted APIs
stop at the model's EOS. Their log probs are whatever the server reports (llama.cpp: after
its sampler chain only with ``post_sampling_probs``; hosted APIs: the raw model's).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from policies.serve.backends.base import EngineUnavailable, HttpBackend, Sample
from policies.serve.backends.vllm_wire import token_ids_of
from policies.wire.lane import FinishReason, GenerateRequest


class OpenAIBackend(HttpBackend):
    kind = "openai"

    def __init__(
        self, url: str, *, version: int, tokenizer: PreTrainedTokenizerBase | None, **kw: object
    ) -> None:
        super().__init__(url, **kw)  # type: ignore[arg-type]
        self.version = version
        self.tokenizer = tokenizer

    async def generate_one(self, req: GenerateRequest, seed: int | None) -> Sample:
        body: dict[str, object] = {
            "model": self.name,
            "prompt": req.prompt_token_ids,
            "max_tokens": req.max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "logprobs": 1,
        }
        if req.top_k > 0:
            body["top_k"] = req.top_k
        if seed is not None:
            body["seed"] = seed
        if req.stop_token_ids:
            body["stop_token_ids"] = req.stop_token_ids
        out = await self.call("/v1/completions", body)
        try:
            choice = out["choices"][0]
            tokens, logprobs = self._translate(choice)
            reason = choice.get("finish_reason")
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineUnavailable(f"openai /v1/completions answer lacks {exc}") from None
        finish: FinishReason = reason if reason in ("stop", "length") else "abort"
        return Sample(tokens, logprobs, finish)

    def _translate(self, choice: dict[str, object]) -> tuple[list[int], list[float]]:
        lp = choice.get("logprobs")
        if not isinstance(lp, dict):
            raise EngineUnavailable("the server returned no logprobs")
        content = lp.get("content")
        if isinstance(content, list):  # llama.cpp
            return [int(e["id"]) for e in content], [float(e["logprob"]) for e in content]
        logprobs = [float(x) for x in lp["token_logprobs"]]
        tokens = lp["tokens"]
        if "token_ids" in choice or (tokens and str(tokens[0]).startswith("token_id:")):
            return token_ids_of(choice), logprobs
        if self.tokenizer is None:
            raise EngineUnavailable("token strings cannot be mapped to ids without a tokenizer")
        ids = []
        for piece in tokens:
            enc = self.tokenizer.encode(str(piece), add_special_tokens=False)
            if len(enc) != 1:
                raise EngineUnavailable(f"token {piece!r} is not one vocabulary token")
            ids.append(int(enc[0]))
        return ids, logprobs
