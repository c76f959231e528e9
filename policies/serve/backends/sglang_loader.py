"""sprawl's weight loader for SGLang: versions applied in place, in work proportional to the patch,
through SGLang's own ``POST /update_weights_from_tensor`` with a custom ``load_format``.

Checked against SGLang's source (``sgl-project/sglang``): ``managers/io_struct.py`` at 001067ff
(``UpdateWeightsFromTensorReqInput``: ``serialized_named_tensors`` (one base64 entry per TP rank),
``load_format``, ``flush_cache``, ``abort_all_requests``, ``weight_version``;
``PauseGenerationReqInput.mode``; ``UpdateWeightVersionReqInput``),
``model_executor/model_runner_components/weight_updater.py`` at 027814ef (a ``load_format`` named
in ``--custom-weight-loader`` is ``dynamic_import``-ed and called as ``loader(model,
named_tensors)`` in every TP worker, each tensor first moved to the worker's device),
``utils/safe_pickle.py`` at e735adf8 (``SafeUnpickler``, what ``MultiprocessingSerializer
.deserialize`` loads a rank's entry with) and ``managers/scheduler_update_weights_mixin.py`` at
018c9109 (the call is not guarded: a loader's exception ends the scheduler process). verl's
``delta_sharded`` (``verl-project/verl`` at 1dda039b, ``workers/rollout/sglang_rollout/
delta_loader.py``) drives the same hook.

The operator installs sprawl into SGLang's environment and starts it with ``--custom-weight-loader
policies.serve.backends.sglang_loader.apply_engine_patch`` (:data:`LOADER`); the sidecar
(:mod:`policies.serve.backends.sglang_inplace`) then sends, per TP rank, a **command**: a JSON
object carried as a ``uint8`` tensor named :data:`COMMAND` in a plain pickle of ``[(name,
tensor)]`` (:func:`command_payload`). A plain pickle of a CPU tensor names only
``torch._utils._rebuild_tensor_v2``, ``torch.storage._load_from_bytes`` and
``collections.OrderedDict``, all on ``SafeUnpickler``'s allow-list, so the sidecar builds it with
torch alone (it never imports sglang) and SGLang reads it as it reads its own payloads.

Commands (every one names ``rank``, ``result`` and ``checkpoint``, the directory SGLang started
from):

- ``init``: learn, once per worker, where every checkpoint element lives in the worker's
  parameters (the startup checkpoint loaded through the model's own ``load_weights``, watched:
  :mod:`policies.serve.backends.param_map`), so fused q/k/v and gate/up parameters and
  tensor-parallel slices are SGLang's business; a worker that already learnt does nothing;
- ``apply`` ``{version, path, digest}``: the engine patch at ``path``
  (:mod:`policies.serve.backends.engine_patch`) checked and written in place, all or nothing
  (:mod:`policies.serve.backends.engine_apply`);
- ``undo`` ``{version}``: put back what the update to ``version`` overwrote here, if it was the
  last one (another rank failed it).

**The loader never raises.** SGLang calls it unguarded (an exception would end the server) and
answers ``success`` whatever it found, so every outcome — ``{"ok": true, …}`` or ``{"ok": false,
"error": …}`` — is written as JSON to the command's ``result`` path (island-local, written then
renamed), which the sidecar reads; the sidecar moves SGLang's ``weight_version`` only once every
rank reported success. A command that cannot be read leaves no result (the sidecar says so).

A tensor the map could not place is kept in checkpoint form and reloaded whole through the model's
own ``load_weights`` when a patch touches it. State is per model object (one per worker process;
tests host several ranks in one). Not covered: parameters on an accelerator until
:class:`~policies.serve.backends.engine_apply.EngineWeights` and
:func:`~policies.serve.backends.param_map.learn` read and compare on the host (both index and
check tensors on the CPU today); quantized weights; pipeline parallelism; models whose
``load_weights`` must see every tensor in one call.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from weakref import WeakKeyDictionary

import structlog
import torch

from policies.serve.backends.engine_apply import EngineWeights
from policies.serve.backends.engine_patch import Expected, read
from policies.serve.backends.param_map import checkpoint_shapes, checkpoint_tensors, learn

log = structlog.get_logger(__name__)
LOADER = "policies.serve.backends.sglang_loader.apply_engine_patch"
"""What ``--custom-weight-loader`` names and every update's ``load_format`` is."""
COMMAND = "sprawl.command"


def command_payload(command: dict[str, Any]) -> str:
    """One rank's entry of ``serialized_named_tensors``: ``command`` as SGLang deserializes it."""
    raw = bytearray(json.dumps(command, sort_keys=True).encode())
    tensor = torch.frombuffer(raw, dtype=torch.uint8)
    return base64.b64encode(pickle.dumps([(COMMAND, tensor)], protocol=4)).decode("ascii")


def read_command(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The command among the tensors SGLang hands the loader."""
    found = [t for name, t in named_tensors if name == COMMAND]
    if len(found) != 1:
        raise ValueError(f"expected one {COMMAND!r} tensor, got {len(found)}")
    command = json.loads(found[0].detach().cpu().numpy().tobytes())
    if not isinstance(command, dict):
        raise ValueError("a command is a JSON object")
    return command


@dataclass
class _Worker:
    """What one worker learnt: its weights seen in checkpoint coordinates."""

    weights: EngineWeights
    expected: Expected
    """Checkpoint name → (dtype served, shape): what an engine patch may name."""


_WORKERS: WeakKeyDictionary[torch.nn.Module, _Worker] = WeakKeyDictionary()


def apply_engine_patch(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """SGLang's custom loader (:data:`LOADER`): run the command and write its outcome (module
    docstring). Never raises."""
    try:
        command = read_command(named_tensors)
        result = Path(str(command["result"]))
    except Exception as exc:  # SGLang would end the server: nothing to report to, so log it
        log.error("sglang_loader.unreadable_command", error=f"{type(exc).__name__}: {exc}")
        return
    try:
        outcome = _run(model, command)
    except Exception as exc:  # every failure is the result, never SGLang's exception
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1000]}
    outcome.update(op=command.get("op"), version=command.get("version"), rank=command.get("rank"))
    try:
        tmp = result.with_name(result.name + ".tmp")
        tmp.write_text(json.dumps(outcome))
        tmp.replace(result)
    except OSError as exc:
        log.error("sglang_loader.result_unwritable", result=str(result), error=str(exc))


def _run(model: torch.nn.Module, command: dict[str, Any]) -> dict[str, Any]:
    worker = _WORKERS.get(model)
    if worker is None:
        worker = _learn(model, str(command["checkpoint"]))
        _WORKERS[model] = worker
    op = command.get("op")
    if op == "init":
        pmap = worker.weights.map
        return {"ok": True, "mapped": len(pmap.boxes), "unmapped": sorted(pmap.unmapped)}
    if op == "undo":
        undone = worker.weights.undo(int(command["version"]))
        _synchronize(model)
        return {"ok": True, "undone": undone}
    if op == "apply":
        version, frames, whole = read(str(command["path"]), str(command["digest"]), worker.expected)
        if version != int(command["version"]):
            raise ValueError(f"the engine patch is for version {version}, not {command['version']}")
        worker.weights.apply(version, frames, whole)
        _synchronize(model)
        return {"ok": True}
    raise ValueError(f"unknown command {op!r}")


def _learn(model: torch.nn.Module, checkpoint: str) -> _Worker:
    """Where the startup checkpoint's elements live in ``model`` (its own loader, watched)."""
    directory = _local(checkpoint)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    load = cast(Callable[[list[tuple[str, torch.Tensor]]], object], model.load_weights)
    pmap = learn(load, model.named_parameters(), checkpoint_tensors(directory, dtype))
    copies = {
        n: t.reshape(-1).clone() for n, t in checkpoint_tensors(directory, dtype, pmap.unmapped)
    }

    def reload(tensors: list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]]) -> None:
        """The model's own loader, for the tensors the map could not place: each whole, from
        its copy (already written)."""
        load([(name, copies[name].view(shape)) for name, shape, _, _ in tensors])

    log.info("sglang_loader.weights_mapped", mapped=len(pmap.boxes), unmapped=sorted(pmap.unmapped))
    return _Worker(EngineWeights(pmap, copies, reload), checkpoint_shapes(directory, dtype))


def _local(checkpoint: str) -> str:
    """The directory of the checkpoint SGLang started from (``--model-path``; a hub id is looked
    up in the local cache only)."""
    if os.path.isdir(checkpoint):
        return checkpoint
    from huggingface_hub import snapshot_download

    return str(snapshot_download(checkpoint, local_files_only=True))


def _synchronize(model: torch.nn.Module) -> None:
    """Writes on an accelerator are done before SGLang's next step reads them."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
