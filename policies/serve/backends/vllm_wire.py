"""vLLM's generation routes as the sidecar speaks them: the request bodies and reading the answers.

Two routes, one sample each (``n`` 1; the lane's ``n`` is ``n`` requests seeded ``seed + i``):

- ``POST /inference/v1/generate`` (vLLM ≥ 0.32 started with ``--enable-scale-out``): token ids in
  (``token_ids``), ``sampling_params`` out of the request, ``output_mode: "tokens"``; each choice
  carries ``token_ids``, ``logprobs.content[{token_id, logprob}]``, ``routed_experts`` and
  ``weight_versions`` (``[{version, start, end}]``: the labels of the weights that sampled each
  span of the output, which the sidecar cross-checks against its own stamps);
- ``POST /v1/completions`` (any vLLM): ``prompt`` = token ids, the same sampling fields at the
  top level; token ids from the choice's ``token_ids`` (else the ``"token_id:N"`` strings of
  ``logprobs.tokens``), log probs from ``logprobs.token_logprobs``; no version spans.

**Every sampling field is sent explicitly** (vLLM fills omitted ones from the model's
``generation_config.json``, and a ``top_k`` there would change what is sampled). Log probs are of
the distribution sampled when vLLM runs with ``--logprobs-mode processed_logprobs``. A choice's
``routed_experts`` (an MoE model, ``--enable-return-routed-experts``) is the lane's form and is
checked to hold one row per forwarded position. A malformed answer is
:class:`~policies.serve.backends.base.EngineUnavailable` naming what it lacked.
"""

from __future__ import annotations

from typing import Any

from policies.serve.backends.base import EngineUnavailable, Sample
from policies.wire.lane import FinishReason, GenerateRequest
from policies.wire.routing import checked_routing, routing_rows

TITO = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"


def sampling_fields(req: GenerateRequest, seed: int | None) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` for ``req``, every field that changes sampling explicit."""
    return {
        "max_tokens": req.max_tokens,
        "n": 1,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k if req.top_k > 0 else -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "ignore_eos": False,
        "stop_token_ids": req.stop_token_ids,
        "seed": seed,
        "logprobs": 0,
        "skip_special_tokens": False,
        "routed_experts_prompt_start": req.routed_experts_prompt_start,
    }


def tito_body(model: str, req: GenerateRequest, seed: int | None) -> dict[str, Any]:
    """The ``/inference/v1/generate`` request."""
    params = {**sampling_fields(req, seed), "detokenize": False}
    return {
        "model": model,
        "token_ids": req.prompt_token_ids,
        "sampling_params": params,
        "output_mode": "tokens",
    }


def completions_body(model: str, req: GenerateRequest, seed: int | None) -> dict[str, Any]:
    """The ``/v1/completions`` request."""
    return {
        "model": model,
        "prompt": req.prompt_token_ids,
        **sampling_fields(req, seed),
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }


def token_ids_of(choice: dict[str, Any]) -> list[int]:
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


def read_sample(route: str, out: Any, req: GenerateRequest) -> Sample:
    """The sample in ``route``'s answer ``out``."""
    try:
        choice = out["choices"][0]
        if route == TITO:
            tokens = [int(i) for i in choice["token_ids"]]
            logprobs = [float(c["logprob"]) for c in choice["logprobs"]["content"]]
            spans = choice.get("weight_versions")
            versions = (
                None
                if spans is None
                else [(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans]
            )
        else:
            tokens = token_ids_of(choice)
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            versions = None
        reason = choice.get("finish_reason")
        routed = choice.get("routed_experts")
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise EngineUnavailable(f"vllm {route} answer lacks {exc}") from None
    if len(tokens) != len(logprobs):
        raise EngineUnavailable("vllm returned a log prob count that differs from the tokens")
    if routed is not None:
        rows = routing_rows(len(req.prompt_token_ids), len(tokens), req.routed_experts_prompt_start)
        try:
            routed = checked_routing(str(routed), rows, "vllm routed_experts")
        except ValueError as exc:
            raise EngineUnavailable(str(exc)) from None
    finish: FinishReason = reason if reason in ("stop", "length") else "abort"
    return Sample(tokens, logprobs, finish, routed, versions)
