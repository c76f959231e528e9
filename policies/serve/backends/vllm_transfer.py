"""sprawl's weight-transfer backend for vLLM: versions applied in place, in work proportional to
the patch, through vLLM's own RL interface.

vLLM (≥ 0.32) loads weight-transfer backends from a registry
(``vllm.distributed.weight_transfer.WeightTransferEngineFactory``); sprawl's package registers
``"sprawl"`` there from a ``vllm.general_plugins`` entry point
(:mod:`policies.serve.backends.vllm_plugin`), so installing
sprawl into the engine's environment and starting vLLM with ``--weight-transfer-config
'{"backend": "sprawl"}'`` (and ``VLLM_SERVER_DEV_MODE=1`` for the routes) is all an operator
adds. The sidecar (:mod:`policies.serve.backends.vllm_inplace`) then drives vLLM's routes::

    POST /init_weight_transfer_engine {"init_info": {}}            (once, on connect)
    POST /start_weight_update → /update_weights {"update_info": {"path", "digest", "part"}}
        → /finish_weight_update {}            (each part as its chunks land: read ahead on a
                                               thread, the engine serving on)
    POST /pause?mode=keep → /start_weight_update
    POST /update_weights {"update_info": {"parts": [[path, digest], …]}}
    POST /finish_weight_update {"weight_version": "<sprawl version>"} → /resume

Each part is an engine patch (:mod:`policies.serve.backends.engine_patch`: the board's own patch
frames the shadow applied, as they crossed the link) that the sidecar wrote on the island; the
parts since the version the engine serves make the update.

:meth:`~SprawlWeightTransferEngine.init_transfer_engine` learns, once per worker, where every
checkpoint element lives in the worker's parameters: it loads the checkpoint the engine started
from through the model's own ``load_weights`` and watches its final ``Tensor.copy_`` calls
(:mod:`policies.serve.backends.param_map`), so fused parameters, tensor-parallel slices (each
rank learns its own part) and tied heads are vLLM's business. An update then checks the file
(digest, each frame's checksum, names, dtypes, shapes), reads the values at the positions each
frame writes from the parameters, computes the new ones and checks them against the frame's
target checksums, then writes them, all or nothing
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

from dataclasses import dataclass
from typing import Any

import structlog
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.checkpoint_weight_patch import (
    CheckpointWeightPatch,
    load_checkpoint_weight_patches,
)

from policies.serve.backends.engine_apply import EngineWeights, Updates, warm_up
from policies.serve.backends.param_map import checkpoint_shapes, checkpoint_tensors, learn

log = structlog.get_logger(__name__)


@dataclass
class SprawlInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """Nothing to rendezvous with: patches arrive as island-local files."""


@dataclass
class SprawlUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One of: a part of an engine patch to read ahead (``path``, the file's ``digest`` and
    ``part``, its place among the parts since the version the engine serves; returns at once),
    the parts to write (``parts``: ``[path, digest]`` each, in order), or ``undo``: the version
    whose update this worker is to take back (a no-op unless it was its last)."""

    path: str | None = None
    digest: str | None = None
    part: int = 0
    parts: list[list[str]] | None = None
    undo: int | None = None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


class SprawlWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    """The worker side of the ``sprawl`` backend (see the module docstring)."""

    init_info_cls = SprawlInitInfo
    update_info_cls = SprawlUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expected = checkpoint_shapes(self.model_config.model, self.model_config.dtype)
        self.updates: Updates | None = None

    def init_transfer_engine(self, init_info: SprawlInitInfo) -> None:
        """Make every weight writable in place (on the CPU build: unpack) and learn where each
        checkpoint element lives; once per worker (the engine still on its startup weights)."""
        if self.updates is not None:
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
            checkpoint_tensors(self.model_config.model, self.model_config.dtype),
        )
        copies = {
            name: t.reshape(-1).clone()
            for name, t in checkpoint_tensors(self.model_config.model, self.model_config.dtype)
            if name in pmap.unmapped
        }
        weights = EngineWeights(pmap, copies, self._load_sparse)
        self.updates = Updates(weights, self.expected)
        warm_up()
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
        """Read a part ahead, write the parts of an engine patch in place (all or nothing), or
        put back what the update to ``undo`` overwrote here (if it was the last one)."""
        updates = self.updates
        if updates is None:
            raise RuntimeError("init_weight_transfer_engine first: the weights are not mapped")
        if update_info.undo is not None:
            updates.undo(update_info.undo)
        elif update_info.parts is not None:
            updates.write([(str(p), str(d)) for p, d in update_info.parts])
        elif update_info.path is not None and update_info.digest is not None:
            updates.prepare(update_info.part, update_info.path, update_info.digest)
        else:
            raise ValueError("update_info needs parts, path and digest, or undo")

    def shutdown(self) -> None:
        """Stop the reader thread."""
        if self.updates is not None:
            self.updates.close()


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
