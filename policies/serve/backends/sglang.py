"""SGLang behind the sidecar: token ids in and out, versions kept in an island-local directory.

Checked against SGLang's own code (``sgl-project/sglang``: ``managers/io_struct.py`` at
001067ff, ``sampling/sampling_params.py`` at 00c17caf, ``entrypoints/http_server.py``,
``model_executor/model_runner.py``, ``model_loader/weight_utils.py``; the 0.5.x line).

Generation: ``POST /generate`` with ``input_ids``, ``return_logprob: true`` and **every sampling
field sent explicitly** (``max_new_tokens``, ``min_new_tokens`` 0, ``temperature``, ``top_p``,
``top_k`` (−1 = off), ``min_p`` 0, ``frequency_penalty`` 0, ``presence_penalty`` 0,
``repetition_penalty`` 1, ``stop`` [], ``stop_token_ids``, ``ignore_eos`` false, ``n`` 1,
``sampling_seed``, ``skip_special_tokens`` false, ``no_stop_trim`` true), so neither the
server's ``--preferred-sampling-params`` nor a model default changes what is sampled. Tokens and
log probs come from ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]``), the finish
reason from ``meta_info.finish_reason.type``. SGLang reports ``log_softmax(logits /
temperature)`` there — the distribution sampled when nothing truncates it (temperature 0 is
greedy: top-k 1 over the untempered logits, the reference engine's convention). When top-k or
top-p truncates, the request also asks ``return_sampling_mask: true`` and the log probs are
``meta_info.output_token_sampling_logprobs`` (renormalized over the support actually sampled);
a server too old to return them is an :class:`EngineUnavailable`, never a silently different
number. ``SGLANG_RETURN_ORIGINAL_LOGPROB`` must stay unset (it reports the raw distribution).
The context length is the engine's (``GET /v1/models`` → ``max_model_len``), read by
:meth:`SGLangBackend.connect`.

MoE routing: when the server runs with ``--enable-return-routed-experts`` (``GET
/get_server_info`` → ``enable_return_routed_experts``, read by :meth:`SGLangBackend.connect`), a
request also asks ``return_routed_experts: true`` (and ``routed_experts_start_len`` when the
lane's ``routed_experts_prompt_start`` is not 0), and ``meta_info.routed_experts`` — base64 of
the ``int32`` ids ``[tokens, num_hidden_layers, num_experts_per_tok]`` — is returned in the
lane's form (:func:`~policies.wire.routing.from_int32`), checked to hold one row per forwarded
position. The shape comes from the run's ``config.json`` (read from the board at the first
stage; before it, no routing is asked for). Not covered: models with dense layers among their
MoE layers (SGLang reports a row for every layer).

Versions (this class: ``--sglang-update disk``, the fallback for an SGLang without sprawl's loader;
:mod:`policies.serve.backends.sglang_inplace` writes them in place, the default): **stage**
advances the island's :class:`~policies.serve.backends.shadow.Shadow` with patches from the board
(the link carries patches, not checkpoints), then brings the directory ``materialize_dir`` (which
the SGLang server must be able to read) to the staged version by writing **only the tensors it
does not hold yet**. The layout is one safetensors file per tensor,
named by the tensor and its checksum (content addressed: a file never changes once written, so
rewriting in place under a live engine never happens), next to the board's ``base/`` files
(``config.json``, tokenizer; written once) and ``model.safetensors.index.json``. SGLang's loader
reads exactly the files the index names (``filter_duplicate_safetensors_files``), so the index is
the version: stage writes the new index beside the live one (``….index.json.next``); **apply**
renames it into place and calls ``POST /update_weights_from_disk`` ``{model_path, load_format:
"safetensors", weight_version, flush_cache: true, abort_all_requests: false}`` →
``{success, message, num_paused_requests}`` (HTTP 400 when not ``success``). Mode ``"pause"``
wraps it in ``POST /pause_generation {"mode": "retract"}`` … ``POST /continue_generation``
(running requests go back to the queue and recompute their KV cache on the new weights; the flush
under a retract pause needs sgl-project/sglang#31962, before which SGLang's update asserts on the
refused flush); mode ``"wait"`` drains first (the base class).

All-or-nothing: the previous version's files stay on disk until the engine has taken the new
one. If the update fails, the previous index is put back and the engine reloads it
(``update_weights_from_disk`` again, with the previous ``weight_version``), and the failure is an
:class:`~policies.errors.EngineError`: the sidecar keeps serving the old version, counts the
failure and retries with backoff. If the put-back fails too, every request is a 503 (and, in
``"pause"`` mode, the retracted requests stay paused) until a later activation succeeds: a full
reload from the directory makes the engine consistent again. Files no index names are removed
after a successful switch; tensor files an earlier process left are removed at the first stage
(this process trusts only what it wrote). Not covered: several SGLang servers reading
one directory (give each island its own).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
import xxhash
from safetensors.torch import save as st_save

from policies.board import Board
from policies.codec.digests import storage_key
from policies.errors import EngineError
from policies.serve.backends.base import EngineUnavailable, HttpBackend, Sample
from policies.serve.backends.shadow import Shadow, Staged
from policies.serve.types import QuiesceMode
from policies.wire.lane import FinishReason, GenerateRequest
from policies.wire.routing import from_int32, routing_rows

log = structlog.get_logger(__name__)

"""How an SGLang island takes a version: an engine patch through ``update_weights_from_tensor`` and
sprawl's custom loader (:mod:`policies.serve.backends.sglang_inplace`), or the changed tensors
through a directory and ``update_weights_from_disk`` (this module)."""
INDEX = "model.safetensors.index.json"
NEXT_INDEX = INDEX + ".next"
WEIGHT_GLOB = "t-*.safetensors"


def tensor_file(name: str, checksum: str) -> str:
    """The file holding tensor ``name`` with content ``checksum`` (content addressed)."""
    return f"t-{xxhash.xxh3_64_hexdigest(name.encode())}-{checksum}.safetensors"


def weight_map(staged: Staged, view: dict[str, torch.Tensor]) -> dict[str, str]:
    """Tensor name → file for every stored tensor (a tied alias is stored once, as the anchor
    format does, and left out of the index as HF checkpoints do)."""
    seen: set[object] = set()
    out: dict[str, str] = {}
    for name in sorted(view):
        key = storage_key(view[name])
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor_file(name, staged.manifest.tensors[name].checksum)
    return out


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a sibling file, then rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def index_bytes(version: int, digest: str, files: dict[str, str]) -> bytes:
    meta = {"sprawl_version": version, "sprawl_digest": digest}
    return json.dumps({"metadata": meta, "weight_map": files}, indent=1).encode()


@dataclass(frozen=True)
class DirState:
    """One version as the directory holds it: its index entries."""

    version: int
    digest: str
    files: dict[str, str]


def moe_shape(config: bytes) -> tuple[int, int, int] | None:
    """(layers, experts per token, experts) of an MoE model's ``config.json`` as SGLang captures
    its routing (its text config's ``num_hidden_layers`` and ``num_experts_per_tok``); None for a
    dense model."""
    model = json.loads(config)
    model = model.get("text_config", model)
    experts = model.get("num_experts") or model.get("num_local_experts") or 0
    top_k = model.get("num_experts_per_tok") or 0
    if not (experts and top_k):
        return None
    return int(model["num_hidden_layers"]), int(top_k), int(experts)


class SGLangBackend(HttpBackend):
    kind = "sglang"

    def __init__(self, url: str, *, materialize_dir: Path, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.materialize_dir = materialize_dir
        self.shadow = Shadow("sglang")
        self.broken: str | None = None
        self.tensors_written = 0
        """Tensor files written so far (each activation writes only what changed)."""
        self._live: DirState | None = None
        self._next: DirState | None = None
        self._base_written = False
        self.routing = False
        """Whether the server returns MoE routing (``--enable-return-routed-experts``)."""
        self.server_info: dict[str, Any] = {}
        """``GET /get_server_info`` as :meth:`connect` read it (SGLang's server arguments)."""
        self._moe: tuple[int, int, int] | None = None
        """The run's model as SGLang captures its routing (:func:`moe_shape`)."""

    async def connect(self) -> None:
        """Read the served model's context length from the engine (``max_model_len``) and
        whether it returns MoE routing."""
        out = await self.call("/v1/models")
        models = out.get("data") if isinstance(out, dict) else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict):
            raise EngineUnavailable(f"sglang /v1/models lists no model: {out!r}"[:300])
        try:
            self.max_context = int(models[0]["max_model_len"])
        except (KeyError, TypeError, ValueError):
            msg = f"sglang /v1/models has no max_model_len: {out!r}"[:300]
            raise EngineUnavailable(msg) from None
        info = await self.call("/get_server_info")
        self.server_info = info if isinstance(info, dict) else {}
        self.routing = self.server_info.get("enable_return_routed_experts") is True

    # -- generation -----------------------------------------------------------------------------
    async def generate_one(self, req: GenerateRequest, seed: int | None) -> Sample:
        if self.broken is not None:
            raise EngineUnavailable(self.broken)
        truncated = req.temperature > 0 and (req.top_k > 0 or req.top_p < 1.0)
        params: dict[str, object] = {
            "max_new_tokens": req.max_tokens,
            "min_new_tokens": 0,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k if req.top_k > 0 else -1,
            "min_p": 0.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "stop": [],
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": False,
            "n": 1,
            "sampling_seed": seed,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        body: dict[str, object] = {
            "input_ids": req.prompt_token_ids,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "stream": False,
        }
        if truncated:
            body["return_sampling_mask"] = True
        moe = self._moe if self.routing else None
        if moe is not None:
            body["return_routed_experts"] = True
            if req.routed_experts_prompt_start:
                body["routed_experts_start_len"] = req.routed_experts_prompt_start
        out = await self.call("/generate", body)
        if isinstance(out, list):
            out = out[0]
        try:
            meta = out["meta_info"]
            triples = meta["output_token_logprobs"]
            tokens = [int(t[1]) for t in triples]
            logprobs = [float(t[0]) for t in triples]
            kind = (meta.get("finish_reason") or {}).get("type", "abort")
            if truncated:
                sampled = meta.get("output_token_sampling_logprobs")
                if not isinstance(sampled, list):
                    raise EngineUnavailable(
                        "sglang returned no output_token_sampling_logprobs for a top-k/top-p "
                        "request: its log probs would not be of the distribution sampled (use "
                        "an SGLang release with return_sampling_mask, or top_k 0 and top_p 1)"
                    )
                logprobs = [float(x) for x in sampled]
            routed = meta.get("routed_experts") if moe is not None else None
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineUnavailable(f"sglang /generate answer lacks {exc}") from None
        if len(tokens) != len(logprobs):
            raise EngineUnavailable("sglang returned a log prob count that differs from the tokens")
        if moe is not None:
            routed = self._routing(req, len(tokens), routed, moe)
        finish: FinishReason = kind if kind in ("stop", "length") else "abort"
        return Sample(tokens, logprobs, finish, routed)

    @staticmethod
    def _routing(
        req: GenerateRequest, completion: int, routed: object, moe: tuple[int, int, int]
    ) -> str:
        """SGLang's routing of a choice in the lane's form (module docstring)."""
        if not isinstance(routed, str):
            raise EngineUnavailable("sglang returned no meta_info.routed_experts")
        layers, top_k, experts = moe
        rows = routing_rows(len(req.prompt_token_ids), completion, req.routed_experts_prompt_start)
        try:
            return from_int32(routed, (rows, layers, top_k), experts, "sglang routed_experts")
        except ValueError as exc:
            raise EngineUnavailable(str(exc)) from None

    # -- versions -------------------------------------------------------------------------------
    async def stage(self, board: Board, version: int) -> None:
        staged = await anyio.to_thread.run_sync(self.shadow.stage, board, version)
        _, view = self.shadow.take(version)
        changed = self.shadow.changed(staged)
        written = await anyio.to_thread.run_sync(self._write, board, staged, view)
        log.info(
            "sglang_staged",
            version=version,
            board_bytes_read=staged.bytes_read,
            changed=len(view) if changed is None else len(changed),
            tensors_written=written,
        )

    def _write(self, board: Board, staged: Staged, view: dict[str, torch.Tensor]) -> int:
        """Bring the directory's files to ``staged`` (blocking); the tensor files written."""
        d = self.materialize_dir
        d.mkdir(parents=True, exist_ok=True)
        if not self._base_written:
            base = board.base_files()
            for name, data in base.items():
                write_atomic(d / name, data)
            self._moe = moe_shape(base["config.json"]) if "config.json" in base else None
            # files left by an earlier process may be torn: this process trusts only its own
            for old in d.glob(WEIGHT_GLOB):
                old.unlink()
            self._base_written = True
        files = weight_map(staged, view)
        written = 0
        for name, file in files.items():
            if not (d / file).exists():
                write_atomic(d / file, st_save({name: view[name].detach().cpu().contiguous()}))
                written += 1
        self._next = DirState(staged.version, staged.manifest.digest, files)
        write_atomic(d / NEXT_INDEX, index_bytes(staged.version, staged.manifest.digest, files))
        self.tensors_written += written
        return written

    async def _load(self, state: DirState) -> None:
        """Make ``state`` the directory's version and have the engine load it."""
        index = index_bytes(state.version, state.digest, state.files)
        await anyio.to_thread.run_sync(write_atomic, self.materialize_dir / INDEX, index)
        out = await self.call(
            "/update_weights_from_disk",
            {
                "model_path": str(self.materialize_dir),
                "load_format": "safetensors",
                "weight_version": str(state.version),
                "flush_cache": True,
                "abort_all_requests": False,
            },
        )
        if not isinstance(out, dict) or out.get("success") is not True:
            raise EngineError(f"sglang did not load version {state.version}: {out!r}"[:500])

    async def apply(self, version: int, mode: QuiesceMode) -> None:
        staged, _ = self.shadow.take(version)
        target = self._next
        if target is None or target.version != version:
            raise EngineError(f"version {version} was not written to {self.materialize_dir}")
        if mode == "pause":
            await self.call("/pause_generation", {"mode": "retract"})
        try:
            try:
                await self._load(target)
            except EngineError as exc:
                await self._put_back(version, exc)
                raise EngineError(
                    f"sglang refused version {version}: {exc}; "
                    f"put back on {None if self._live is None else self._live.version}"
                ) from exc
            self.broken = None
        finally:
            # paused requests resume only on weights that are a version: while the engine is
            # broken they stay retracted until a later activation lands
            if mode == "pause" and self.broken is None:
                await self.call("/continue_generation", {})
        self.shadow.activated(staged)
        self._live, self._next = target, None
        await anyio.to_thread.run_sync(self._collect)

    async def _put_back(self, version: int, exc: EngineError) -> None:
        live = self._live
        if live is None:
            return  # nothing was served yet: the sidecar keeps answering 409 (state failed)
        log.warning("sglang_putting_back", version=version, previous=live.version, error=str(exc))
        try:
            await self._load(live)
        except EngineError as again:
            self.broken = (
                f"sglang failed version {version} and could not be put back on "
                f"{live.version}: {again}"
            )[:500]
            raise EngineUnavailable(self.broken) from again

    def _collect(self) -> None:
        """Remove tensor files no index names (the previous version's changed tensors)."""
        keep = set(self._live.files.values()) if self._live is not None else set()
        for path in self.materialize_dir.glob(WEIGHT_GLOB):
            if path.name not in keep:
                path.unlink(missing_ok=True)
        (self.materialize_dir / NEXT_INDEX).unlink(missing_ok=True)
