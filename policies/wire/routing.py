"""The wire form of MoE routing: ``routed_experts`` as vLLM 0.32 returns it.

vLLM (``--enable-return-routed-experts``) answers each choice with ``routed_experts``: the
base64 of a NumPy ``.npy`` file (``np.save``, no pickle) holding an array
``[tokens, layers, top_k]`` of expert ids, ``uint8`` when the model has at most 256 experts,
else ``uint16``. Its rows are the positions of prompt + completion from the request's
``routed_experts_prompt_start`` on, except the last sampled token (it was never forwarded, so it
has no routing): ``len(prompt) + len(completion) - 1 - routed_experts_prompt_start`` rows. The
lane, the trajectory log and the batch protocol carry that same string.

Importing this module does not import torch.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray


def encode_routing(ids: NDArray[np.integer], experts: int) -> str:
    """``ids`` ``[tokens, layers, top_k]`` in vLLM's ``routed_experts`` form."""
    dtype = np.uint8 if experts <= 256 else np.uint16
    with io.BytesIO() as buffer:
        np.save(buffer, np.ascontiguousarray(ids, dtype=dtype), allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_routing(text: str, what: str = "routed_experts") -> NDArray[np.int64]:
    """The ``[tokens, layers, top_k]`` ids of a ``routed_experts`` string (as int64).

    Raises ``ValueError`` naming ``what`` when the text is not such an array."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise ValueError(f"{what}: not a base64 .npy array: {exc}") from exc
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{what}: expected integer expert ids [tokens, layers, top_k], got "
            f"{array.dtype} of shape {array.shape}"
        )
    ids: NDArray[np.int64] = array.astype(np.int64)
    return ids


def join_routing(parts: Sequence[tuple[int, str | None]]) -> str | None:
    """One ``routed_experts`` for positions ``0 ..`` of a sequence from its model calls'
    ``(start, routed_experts)`` in order, each starting where the previous one ended; None when a
    call has no routing or the calls leave a gap or overlap (then no position's routing is
    trusted: the sequence is scored without replay)."""
    arrays: list[NDArray[np.int64]] = []
    covered = 0
    for start, text in parts:
        if text is None or start != covered:
            return None
        ids = decode_routing(text)
        arrays.append(ids)
        covered += ids.shape[0]
    if not arrays:
        return None
    joined = np.concatenate(arrays)
    return encode_routing(joined, int(joined.max(initial=0)) + 1)
