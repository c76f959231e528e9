"""The vLLM worker extension sprawl ships: load a board version into the live weights in place.

Start vLLM with ``--worker-extension-cls policies.serve.backends.vllm_worker.SprawlWorkerExtension``
(sprawl installed in the server's environment). vLLM mixes this class into every GPU worker, so
``POST /collective_rpc {"method": "sprawl_load_version", "args": [board_url, run, version]}``
runs :meth:`SprawlWorkerExtension.sprawl_load_version` on each worker.

Guarantees: the view is read with ``Board.load`` (every tensor's checksum verified against the
manifest, so a corrupted version raises before any weight changes); it is handed to the model's
own ``load_weights``, which maps HF names onto vLLM's fused/sharded parameters and copies into
the existing tensors in place (no reallocation, so CUDA graphs stay valid). The return value is
the version's manifest digest, so the sidecar can check that every worker loaded the same state.

Not covered: the view must be in a dtype the model's weight loaders accept (the bf16 view is;
quantized views need the matching vLLM quantization config).
"""

from __future__ import annotations

from typing import Any

from policies.board import Board


class SprawlWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's model runner."""

    model_runner: Any

    def sprawl_load_version(self, board_url: str, run: str, version: str) -> str:
        manifest, view = Board(board_url, run).load(int(version))
        model = self.model_runner.model
        device = next(model.parameters()).device
        model.load_weights(weights=((name, t.to(device)) for name, t in view.items()))
        return manifest.digest
