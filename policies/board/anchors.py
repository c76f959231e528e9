"""An anchor's bytes: the safetensors payload of a full view, and an anchor read back verified.

Guarantees: :func:`anchor_payload` stores each storage once (tied names are left out as
aliases) and is bit-identical for the same view; :func:`read_anchor` returns a version's full
view only if its file holds the manifest's byte count, loads, names exactly the manifest's
tensors (aliases restored) and every tensor matches its ``sum-128`` checksum — else
:class:`VersionCorrupt` naming the version. A sharded anchor is assembled from its pieces
(:func:`policies.board.sharded_read.read_sharded_anchor`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from policies.board.index import BoardIndex
from policies.board.sharded_read import read_sharded_anchor
from policies.board.types import WEIGHTS, Manifest
from policies.codec.digests import storage_key, tensor_checksum
from policies.errors import VersionCorrupt


def anchor_payload(view: Mapping[str, torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    """The safetensors bytes of a full view (each storage once) and the aliases left out."""
    primary: dict[object, str] = {}
    ptrs: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name in sorted(view):
        t = view[name].detach().cpu().contiguous()
        key = storage_key(t)
        if key in primary:
            aliases[name] = primary[key]
            continue
        primary[key] = name
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in ptrs and t.numel() else t
        ptrs.add(ptr)
    return st_save(tensors), aliases


def read_anchor(index: BoardIndex, m: Manifest) -> dict[str, torch.Tensor]:
    """The full view of the anchor ``m`` (whole, or assembled from its pieces), verified."""
    if m.shards:
        return read_sharded_anchor(index, m)
    payload = index.read_exact(m.version, WEIGHTS, m.bytes)
    try:
        tensors = st_load(payload)
    except Exception as exc:  # safetensors raises its own untyped errors on torn files
        raise VersionCorrupt(f"version {m.version}: weights unreadable: {exc}") from None
    for alias, primary in m.aliases.items():
        if primary not in tensors:
            raise VersionCorrupt(f"version {m.version}: alias {alias} of missing {primary}")
        tensors[alias] = tensors[primary]
    if set(tensors) != set(m.tensors):
        raise VersionCorrupt(f"version {m.version}: tensor names differ from the manifest")
    for name, entry in m.tensors.items():
        if tensor_checksum(tensors[name]) != entry.checksum:
            raise VersionCorrupt(f"version {m.version}: checksum mismatch for {name}")
    return tensors
