"""The wire form of MoE routing: ``routed_experts`` as vLLM 0.32 returns it.

vLLM (``--enable-return-routed-experts``) answers each choice with ``routed_experts``: the
base64 of a NumPy ``.npy`` file (``np.save``, no pickle) holding an array
``[tokens, layers, top_k]`` of expert ids, ``uint8`` when the model has at most 256 experts,
else ``uint16``. Its rows are the positions of prompt + completion from the request's
``routed_experts_prompt_start`` on, except the last sampled token (it was never forwarded, so it
has no routing): ``len(prompt) + len(completion) - 1 - routed_experts_prompt_start`` rows
(:func:`routing_rows`). The lane, the trajectory log and the batch protocol carry that same
string; :func:`checked_routing` holds an engine's answer to that row count, and
:func:`from_int32` turns SGLang's form (base64 of the raw little-endian ``int32`` array, rows
from ``routed_experts_start_len`` as well) into it.

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


def routing_rows(prompt: int, completion: int, start: int) -> int:
    """The rows a choice's ``routed_experts`` holds (module docstring)."""
    return max(prompt + completion - 1 - start, 0)


def checked_routing(text: str, rows: int, what: str = "routed_experts") -> str:
    """``text`` unchanged when it is a routing of ``rows`` positions; else ``ValueError`` naming
    ``what`` and both counts."""
    got = decode_routing(text, what).shape[0]
    if got != rows:
        raise ValueError(f"{what}: {got} positions routed, expected {rows}")
    return text


def from_int32(
    text: str, shape: tuple[int, int, int], experts: int, what: str = "routed_experts"
) -> str:
    """SGLang's ``routed_experts`` (base64 of little-endian ``int32`` ids in ``[tokens, layers,
    top_k]`` order) as ``shape`` in vLLM's form; ``ValueError`` naming ``what`` when the text is
    not that many ids in ``[0, experts)``."""
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{what}: not base64: {exc}") from exc
    count = shape[0] * shape[1] * shape[2]
    if len(raw) != 4 * count:
        raise ValueError(f"{what}: {len(raw)} bytes, expected {count} int32 ids {list(shape)}")
    ids = np.frombuffer(raw, dtype="<i4").reshape(shape)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= experts):
        raise ValueError(f"{what}: an expert id outside [0, {experts})")
    return encode_routing(ids, experts)


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
