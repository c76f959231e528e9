"""sprawl's weight-transfer backend for vLLM: versions applied in place, in work proportional to
the patch, through vLLM's own RL interface.

vLLM (≥ 0.32) loads weight-transfer backends from a registry
(``vllm.distributed.weight_transfer.WeightTransferEngineFactory``); sprawl's package registers
``"sprawl"`` there from a ``vllm.general_plugins`` entry point (:func:`register`), so installing
sprawl into the engine's environment and starting vLLM with ``--weight-transfer-config
'{"backend": "sprawl"}'`` (and ``VLLM_SERVER_DEV_MODE=1`` for the routes) is all an operator
adds. The sidecar (:mod:`policies.serve.backends.vllm_inplace`) then drives vLLM's routes::

    POST /init_weight_transfer_engine {"init_info": {}}            (once, on connect)
    POST /start_weight_update → /update_weights {"update_info": {"path", "digest",
        "prepare": true}} → /finish_weight_update {}              (staged: read and planned
                                                                     on a thread, serving)
    POST /pause?mode=keep → /start_weight_update
    POST /update_weights {"update_info": {"path": …, "digest": …}}
    POST /finish_weight_update {"weight_version": "<sprawl version>"} → /resume

``path`` is an engine patch (:mod:`policies.serve.backends.engine_patch`: per tensor the
checkpoint positions written since the version the engine serves and each value's change, about
the patch's size) that the sidecar wrote on the island.

:meth:`~SprawlWeightTransferEngine.init_transfer_engine` learns, once per worker, where every
checkpoint element lives in the worker's parameters: it loads the checkpoint the engine started
from through the model's own ``load_weights`` and watches its final ``Tensor.copy_`` calls
(:mod:`policies.serve.backends.param_map`), so fused parameters, tensor-parallel slices (each
rank learns its own part) and tied heads are vLLM's business. An update then checks the file
(digest, names, dtypes, positions), reads the old values at those positions from the
parameters, checks their sum, adds the changes and writes them, all or nothing
(:mod:`policies.serve.backends.engine_apply`); a tensor the map could not place goes through
vLLM's own ``load_checkpoint_weight_patches`` from a copy the worker keeps.

**vLLM's CPU build prepacks linear weights** at start-up (``dispatch_cpu_unquantized_gemm``
empties ``layer.weight`` and keeps a packed copy only its GEMM kernels read), so there is nothing
for a patch to write. :meth:`~SprawlWeightTransferEngine.init_transfer_engine` therefore gives
each such layer its weight back (the layer's own ``create_weights``, filled by that same load)
and serves it unpacked (``torch.nn.functional.linear``). Decoding is then slower than on the
packed kernels (``orchestrate bench sync --engine vllm`` reports both), but a version costs only
its patch; a GPU build serves the parameters patches write as they are, and this step does
nothing there.

Not covered: quantized served views; the map is learnt while the engine holds its startup
checkpoint (``/init_weight_transfer_engine`` before any update, as the sidecar does); vLLM
releases whose linear layers differ from 0.32's ``LinearBase`` (the CPU unpacking uses its
attributes).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.checkpoint_weight_patch import (
    CheckpointWeightPatch,
    load_checkpoint_weight_patches,
)

from policies.serve.backends.engine_apply import EngineWeights, Plan
from policies.serve.backends.engine_patch import read
from policies.serve.backends.param_map import learn

log = structlog.get_logger(__name__)
BACKEND = "sprawl"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``sprawl`` backend (once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, SprawlWeightTransferEngine.__name__
        )


@dataclass
class SprawlInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """Nothing to rendezvous with: patches arrive as island-local files."""


@dataclass
class SprawlUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One version's engine patch (its island-local path and the file's digest), or ``undo``: the
    version whose update this worker is to take back (a no-op unless it was its last)."""

    path: str | None = None
    digest: str | None = None
    undo: int | None = None
    prepare: bool = False
    """Read and plan ``path`` on a thread of the worker's own, the engine serving on, and return
    at once (the update of the same path and digest then only writes)."""


def _checkpoint(model_dir: str, dtype: torch.dtype) -> dict[str, tuple[str, list[int]]]:
    """``name → (dtype, shape)`` of the checkpoint the engine started from (headers only), each
    in the dtype the engine serves (``dtype``; vLLM casts the checkpoint's to it)."""
    served = str(dtype).removeprefix("torch.")
    found: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as f:
            meta: dict[str, Any] = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        meta.pop("__metadata__", None)
        found.update({k: (served, v["shape"]) for k, v in meta.items()})
    return found


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


class SprawlWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """The worker side of the ``sprawl`` backend (see the module docstring)."""

    init_info_cls = SprawlInitInfo
    update_info_cls = SprawlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expected = _checkpoint(self.model_config.model, self.model_config.dtype)
        self.weights: EngineWeights | None = None
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="sprawl-prepare")
        self.prepared: tuple[str, str, Future[Plan]] | None = None

    def init_transfer_engine(self, init_info: SprawlInitInfo) -> None:
        """Make every weight writable in place (on the CPU build: unpack) and learn where each
        checkpoint element lives; once per worker (the engine still on its startup weights)."""
        if self.weights is not None:
            return
        packed = [
            m
            for m in self.model.modules()
            if hasattr(m, "cpu_linear") and isinstance(getattr(m, "weight", None), torch.Tensor)
        ]
        emptied = [m for m in packed if m.weight.numel() == 0]
        for module in emptied:
            _recreate_weight(module)
        for module in packed:
            module.cpu_linear = _linear
        # the startup values through the model's own loader: refills what was emptied, and
        # shows where each checkpoint element lives
        pmap = learn(
            self.model.load_weights,
            self.model.named_parameters(),
            _startup_weights(self.model_config.model, self.model_config.dtype),
        )
        copies = {
            name: t.reshape(-1).clone()
            for name, t in _startup_weights(self.model_config.model, self.model_config.dtype)
            if name in pmap.unmapped
        }
        self.weights = EngineWeights(pmap, copies, self._load_sparse)
        log.info(
            "vllm.weights_mapped",
            unpacked=len(emptied),
            mapped=len(pmap.boxes),
            unmapped=sorted(pmap.unmapped),
        )

    def _load_sparse(
        self, tensors: list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]]
    ) -> None:
        """vLLM's own sparse loader, for tensors the map could not place."""
        patches = [
            CheckpointWeightPatch(name, shape, values.dtype, values, positions)
            for name, shape, positions, values in tensors
        ]
        load_checkpoint_weight_patches(self.model, patches, validate_unique_indices=False)

    def start_weight_update(self) -> None:
        """In place: nothing to prepare."""

    def finish_weight_update(self) -> None:
        """In place: nothing to finalize."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As the base class, without its accelerator synchronize on a CPU worker."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SprawlUpdateInfo) -> None:
        """Apply the engine patch at ``path`` in place, all or nothing; or, with ``undo``, put
        back what the update to that version overwrote here (if it was the last one)."""
        weights = self.weights
        if weights is None:
            raise RuntimeError("init_weight_transfer_engine first: the weights are not mapped")
        if update_info.undo is not None:
            weights.undo(update_info.undo)
            return
        path, digest = update_info.path, update_info.digest
        if path is None or digest is None:
            raise ValueError("update_info needs path and digest (or undo)")
        if update_info.prepare:
            self.prepared = (path, digest, self.reader.submit(self._plan, weights, path, digest))
            return
        prepared, self.prepared = self.prepared, None
        plan = None
        if prepared is not None and prepared[:2] == (path, digest):
            plan = prepared[2].result()  # read while serving; waits if still reading
        if plan is None or plan.generation != weights.generation:
            plan = self._plan(weights, path, digest)
        weights.commit(plan)

    def _plan(self, weights: EngineWeights, path: str, digest: str) -> Plan:
        version, tensors = read(path, digest, self.expected)
        return weights.plan(version, tensors)

    def shutdown(self) -> None:
        """Stop the reader thread."""
        self.reader.shutdown(wait=False, cancel_futures=True)


def _recreate_weight(module: torch.nn.Module) -> None:
    """Give a prepacked linear layer its (empty) weight parameter back, as its constructor made
    it, and its bias the parameter dtype the packed kernel had changed."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, ReplicatedLinear

    m: Any = module
    replicated = isinstance(m, ReplicatedLinear)
    v2 = type(m.quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED and not replicated
    m.quant_method.create_weights(
        layer=m,
        input_size_per_partition=m.input_size if replicated else m.input_size_per_partition,
        output_partition_sizes=m.output_partition_sizes,
        input_size=m.input_size,
        output_size=m.output_size,
        params_dtype=m.params_dtype,
        weight_loader=m.weight_loader_v2 if v2 else m.weight_loader,
    )
    bias = getattr(m, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.dtype != m.params_dtype:
        bias.data = bias.data.to(m.params_dtype)


def _startup_weights(model_dir: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model directory's safetensors files, one at a time, in the dtype the
    engine serves."""
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                yield name, f.get_tensor(name).to(dtype)
