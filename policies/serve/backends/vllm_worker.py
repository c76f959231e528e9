"""The vLLM worker extension sprawl ships: activate an island-local served view, exactly.

Start vLLM with ``--worker-extension-cls policies.serve.backends.vllm_worker.SprawlWorkerExtension``
(sprawl importable in the engine's environment: ``scripts/build-vllm-env.sh``). vLLM appends
this class to its worker's bases, so each method runs inside every worker process; the sidecar
calls, once a version is staged and then until every worker says it is done::

    POST /collective_rpc {"method": "sprawl_prepare", "args": [path, digest]}
    → {"results": [{"ok": true, "started": …, "done": …} per worker]}

and then, generation paused::

    POST /collective_rpc {"method": "sprawl_activate", "args": [path, digest]}
    → {"results": [{"ok": true, "digest": …, "prepared": …, "check_s": …, "reload_s": …} …]}

:meth:`SprawlWorkerExtension.sprawl_prepare` returns at once and checks and reads the file on a
thread of the worker's own while the engine serves (an RPC runs between engine steps: a read
done in it would hold generation for as long); asked again for the same file it says whether
that is done, and the sidecar pauses only then. The activation (inside the pause) takes the
tensors read, waiting for them if they are not (a sidecar that stopped asking), and reloads:
``check_s`` is that wait (the whole check and read when nothing was prepared), ``reload_s``
vLLM's reload. A preparation is used only for the same path and digest, and only if the file
is still the one it read (same inode, size and modification time); otherwise, or without a
preparation, the activation checks and reads the file itself first. A newer preparation
replaces an older one. The prepared tensors stay in the worker's host memory until the
activation (one served view, which the activation used to read and hold for its own duration).

``path`` is the staged version as an island-local safetensors file (HF names, the served dtype;
no ``lm_head.weight`` when the embeddings are tied), written by the sidecar from its shadow — the
worker never reads the board. This module imports only torch, safetensors and the codec's
digests.

``POST /collective_rpc {"method": "sprawl_footprint"}`` answers, per worker, what sprawl's
weight-transfer backend (the in-place way, :mod:`policies.serve.backends.vllm_transfer`) holds
there and what its last update wrote there: with tensor parallelism, each rank's slice.

Guarantees of :meth:`SprawlWorkerExtension.sprawl_activate` (all-or-nothing):

- the file is checked before any weight changes: the tensor names and shapes of the checkpoint
  the engine started from, every tensor in the served dtype, and its state digest (the board
  manifest's, :func:`policies.codec.digests.state_digest`) equal to ``digest``; a failed check
  returns ``{"ok": false, "changed": false}`` and the engine serves on, untouched;
- the load goes through vLLM's own ``reload_weights(weights_iterator=…,
  is_checkpoint_format=True)`` (HF names onto fused parameters, ``process_weights_after_loading``
  re-run, values copied into the original storage, so nothing is reallocated); a tied LM head is
  re-processed afterwards (on CPUs where vLLM prepacks it, it would keep the old weights);
- a failure once weights started to change puts the model back whole (vLLM's half-done layerwise
  reload is undone) and reloads the previous file, or the startup checkpoint:
  ``{"ok": false, "changed": true, "rolled_back": true}``; if even that fails,
  ``"rolled_back": false`` tells the sidecar the engine must not serve again before a restart.

Not covered: tensor parallelism beyond one worker per file (each worker loads the whole file),
quantized served views (they need vLLM's matching quantization config), vLLM releases whose
private layerwise-reload helpers differ from 0.32's (the rollback path uses them).
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from policies.codec.digests import state_digest

RPC_METHOD = "sprawl_activate"
PREPARE_METHOD = "sprawl_prepare"
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _header(path: str) -> dict[str, tuple[str, list[int]]]:
    """``name → (dtype, shape)`` from a safetensors header (no tensor bytes are read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta: dict[str, Any] = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return {k: (v["dtype"], list(v["shape"])) for k, v in meta.items()}


def _read(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def _identity(path: str) -> tuple[int, int, int]:
    """What tells a file apart from one written in its place: inode, size, modification time."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class _Prepared:
    """A file being checked and read ahead of its activation (:meth:`sprawl_prepare`)."""

    path: str
    digest: str
    identity: tuple[int, int, int]
    tensors: Future[dict[str, torch.Tensor]]

    def serves(self, path: str, digest: str) -> bool:
        """Whether this preparation is of ``path`` as it is now, for ``digest``."""
        try:
            return (path, digest) == (self.path, self.digest) and _identity(path) == self.identity
        except OSError:
            return False


class SprawlWorkerExtension:
    """Mixed into vLLM's worker class (see the module docstring)."""

    model_runner: Any
    vllm_config: Any
    reload_weights: Any  # the worker's own method (vLLM ≥ 0.31)

    def _sprawl(self) -> dict[str, Any]:
        state: dict[str, Any] | None = self.__dict__.get("_sprawl_state")
        if state is None:
            config = self.vllm_config.model_config
            expected: dict[str, tuple[str, list[int]]] = {}
            for f in sorted(glob.glob(os.path.join(config.model, "*.safetensors"))):
                expected.update(_header(f))
            state = {
                "expected": expected,
                "dtype": config.dtype,
                "current": None,
                "prepared": None,
                "reader": ThreadPoolExecutor(1, thread_name_prefix="sprawl-prepare"),
            }
            self.__dict__["_sprawl_state"] = state
        return state

    def _sprawl_check(self, path: str) -> None:
        state = self._sprawl()
        got, want = _header(path), state["expected"]
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            raise ValueError(f"tensor names differ: missing {missing[:5]}, extra {extra[:5]}")
        shapes = [(k, got[k][1], want[k][1]) for k in want if got[k][1] != want[k][1]]
        if shapes:
            raise ValueError(
                f"shapes differ from the checkpoint (name, file, engine): {shapes[:5]}"
            )
        dtypes = [(k, d) for k, (d, _) in got.items() if _ST_DTYPES.get(d) != state["dtype"]]
        if dtypes:
            raise ValueError(f"not the served dtype {state['dtype']}: {dtypes[:5]}")

    def _sprawl_load(self, path: str, digest: str) -> dict[str, torch.Tensor]:
        """``path``'s tensors, checked (names, shapes, dtype, then the state digest ``digest``);
        raises what a bad file raises (``OSError``, ``ValueError``, ``SafetensorError``)."""
        self._sprawl_check(path)
        tensors = _read(path)
        got = state_digest(tensors)
        if got != digest:
            raise ValueError(f"the file's digest {got} is not the version's {digest}")
        return tensors

    def sprawl_prepare(self, path: str, digest: str) -> dict[str, Any]:
        """Start checking and reading ``path`` (for ``digest``) on the worker's reader thread and
        return at once, the engine serving on meanwhile (see the module docstring); asked again
        for the same file, say whether that is ``done`` (the sidecar waits for it before it
        pauses)."""
        state = self._sprawl()
        out: dict[str, Any] = {"ok": False, "path": path, "rank": int(getattr(self, "rank", 0))}
        prepared: _Prepared | None = state["prepared"]
        if prepared is not None and prepared.serves(path, digest):
            out.update(ok=True, started=False, done=prepared.tensors.done())
            return out
        state["prepared"] = None  # another file: the older preparation's tensors are let go
        try:
            identity = _identity(path)
        except OSError as exc:
            out.update(error=f"{type(exc).__name__}: {exc}")
            return out
        future = state["reader"].submit(self._sprawl_load, path, digest)
        state["prepared"] = _Prepared(path, digest, identity, future)
        out.update(ok=True, started=True, done=False)
        return out

    def _sprawl_reload(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """vLLM's in-place reload (None: the startup checkpoint), then the tied head."""
        model = self.model_runner.get_model()
        device = next(model.parameters()).device

        def weights(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in tensors.items():
                yield name, t.to(device)

        it = None if tensors is None else weights(tensors)
        self.reload_weights(weights_iterator=it, is_checkpoint_format=True)
        lm_head = getattr(model, "lm_head", None)
        method = getattr(lm_head, "quant_method", None)
        hf = self.vllm_config.model_config.hf_config
        if getattr(hf, "tie_word_embeddings", False) and method is not None:
            method.process_weights_after_loading(lm_head)

    def sprawl_activate(self, path: str, digest: str) -> dict[str, Any]:
        """Make the served view in ``path`` live, all or nothing (see the module docstring)."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {"ok": False, "path": path, "rank": int(getattr(self, "rank", 0))}
        state = self._sprawl()
        prepared: _Prepared | None = state["prepared"]
        state["prepared"] = None
        if prepared is not None and not prepared.serves(path, digest):
            prepared = None
        out["prepared"] = prepared is not None
        try:
            if prepared is not None:  # read while the engine served; waits if still reading
                tensors = prepared.tensors.result()
            else:
                tensors = self._sprawl_load(path, digest)
        # The RPC boundary: whatever failed is reported to the sidecar as data, nothing changed.
        except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
            out.update(error=f"{type(exc).__name__}: {exc}", changed=False)
            return out
        t1 = time.perf_counter()
        try:
            self._sprawl_reload(tensors)
        except Exception as exc:  # vLLM's loaders raise anything; the model must be put back
            out.update(error=f"{type(exc).__name__}: {exc}", changed=True, **self._sprawl_undo())
            return out
        state["current"] = path
        done = time.perf_counter()
        out.update(
            ok=True,
            digest=digest,
            check_s=round(t1 - t0, 6),
            reload_s=round(done - t1, 6),
            total_s=round(done - t0, 6),
        )
        return out

    def sprawl_status(self) -> dict[str, Any]:
        """The file this worker last activated (None: it serves the startup checkpoint)."""
        return {"current": self._sprawl()["current"], "rank": int(getattr(self, "rank", 0))}

    def sprawl_footprint(self) -> dict[str, Any]:
        """With sprawl's weight-transfer backend: how many elements of each checkpoint tensor
        this worker holds (a tensor-parallel rank: its slice of a sharded one) and, of the last
        in-place update, the positions per tensor offered and written here
        (:meth:`~policies.serve.backends.engine_apply.EngineWeights.footprint`); ``mapped``
        false before ``/init_weight_transfer_engine`` or without that backend."""
        out: dict[str, Any] = {"mapped": False, "rank": int(getattr(self, "rank", 0))}
        updates = getattr(getattr(self, "weight_transfer_engine", None), "updates", None)
        if updates is not None:
            out.update(mapped=True, **asdict(updates.weights.footprint()))
        return out

    def _sprawl_undo(self) -> dict[str, Any]:
        """Put a half-reloaded model back whole, then reload the previous version."""
        from vllm.model_executor.model_loader.reload import layerwise

        model = self.model_runner.get_model()
        try:
            # Layers still waiting for weights sit on ``meta`` with the bad weight buffered;
            # vLLM would replay it at the next reload. Give them their old tensors back.
            for layer in model.modules():
                info = layerwise.LAYERWISE_INFO.get(layer)
                if info is None or not info.can_load():
                    continue
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer, info)
                info.reset()
            layerwise.LOADING_LAYERS.clear()
            if hasattr(model, "_original_do_torchao_reload"):
                model._do_torchao_reload = model._original_do_torchao_reload
            previous = self._sprawl()["current"]
            self._sprawl_reload(None if previous is None else _read(previous))
        except Exception as exc:  # the engine must not serve: the sidecar restarts it
            return {"rolled_back": False, "rollback_error": f"{type(exc).__name__}: {exc}"}
        return {"rolled_back": True, "restored": previous or "the startup checkpoint"}
