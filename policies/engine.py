"""The reference engine's model runner: any HF causal LM, token ids in, tokens + log probs out.

Guarantees:

- each returned log prob is the log probability of the sampled token under the distribution that
  was actually sampled (logits / temperature, then top-k, then top-p, renormalized); greedy
  decoding (temperature 0) reports the log prob under the untempered distribution;
- ``seed`` makes a call reproducible on the same device and weights (choice ``i`` uses
  ``seed + i``);
- a stop token (``stop_token_ids`` or the model's EOS) ends a choice and is included in its
  ``token_ids``, so multi-turn prompts can be continued token-exactly;
- :meth:`Engine.activate` replaces the weights in place, bit for bit, from a served view.

Not covered here: batching of concurrent requests (calls are serialized by the server) and
version bookkeeping (the sidecar owns it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from policies.errors import BadRequest
from policies.lane import FinishReason, GenerateChoice, GenerateRequest


class Engine:
    """Holds one model and its tokenizer; generation is synchronous (run it in a worker thread)."""

    def __init__(self, model_dir: Path, *, device: str = "cpu", dtype: torch.dtype | None = None):
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        self.dtype = dtype or torch.float32
        self.model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)  # type: ignore[no-untyped-call]
        self.model.to(self.device).eval()
        self.max_context = int(getattr(self.config, "max_position_embeddings", 2048))
        self.eos_ids = set(_eos_ids(model_dir, self.tokenizer))
        self.name = model_dir.name

    @torch.no_grad()
    def activate(self, view: Mapping[str, torch.Tensor]) -> None:
        """Copy a served view into the live parameters, in place and bit for bit."""
        params = self.model.state_dict(keep_vars=True)
        missing = [name for name in params if name not in view and not self._tied(name)]
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
            dst.copy_(src.to(dst.dtype))

    def _tied(self, name: str) -> bool:
        tied = getattr(self.model, "_tied_weights_keys", None) or {}
        return name in tied

    @torch.no_grad()
    def generate(self, req: GenerateRequest) -> list[GenerateChoice]:
        """Sample ``req.n`` continuations of ``req.prompt_token_ids``."""
        vocab = int(self.config.vocab_size)
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"token id {bad[0]} outside the vocabulary [0, {vocab})", "prompt_token_ids"
            )
        room = self.max_context - len(req.prompt_token_ids)
        if room <= 0:
            raise BadRequest(
                f"prompt has {len(req.prompt_token_ids)} tokens; the model's context is "
                f"{self.max_context}",
                "prompt_token_ids",
            )
        max_tokens = min(req.max_tokens, room)
        stops = self.eos_ids | set(req.stop_token_ids)
        return [self._sample(req, i, max_tokens, stops) for i in range(req.n)]

    def _sample(
        self, req: GenerateRequest, index: int, max_tokens: int, stops: set[int]
    ) -> GenerateChoice:
        gen = torch.Generator(device=self.device)
        if req.seed is None:
            gen.seed()
        else:
            gen.manual_seed(req.seed + index)
        ids = torch.tensor([req.prompt_token_ids], device=self.device)
        out = self.model(ids, use_cache=True)
        tokens: list[int] = []
        logprobs: list[float] = []
        finish: FinishReason = "length"
        for step in range(max_tokens):
            logits = out.logits[0, -1].float()
            token, logprob = sample_token(logits, req.temperature, req.top_k, req.top_p, gen)
            tokens.append(token)
            logprobs.append(logprob)
            if token in stops:
                finish = "stop"
                break
            if step + 1 < max_tokens:
                nxt = torch.tensor([[token]], device=self.device)
                out = self.model(nxt, cache=out.cache, use_cache=True)
        return GenerateChoice(
            index=index, token_ids=tokens, logprobs=logprobs, finish_reason=finish
        )


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator
) -> tuple[int, float]:
    """Sample one token id from 1-D ``logits``; return it with its log prob as sampled."""
    if temperature == 0.0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    scaled = logits / temperature
    if top_k > 0 and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        outside = (torch.cumsum(probs, -1) - probs) >= top_p
        scaled = scaled.scatter(0, order[outside], float("-inf"))
    logp = torch.log_softmax(scaled, -1)
    token = int(torch.multinomial(logp.exp(), 1, generator=gen))
    return token, float(logp[token])


def _eos_ids(model_dir: Path, tok: PreTrainedTokenizerBase) -> list[int]:
    ids: list[int] = []
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    return ids
