"""The version board: immutable policy versions and one forward-only pointer, on any fsspec URL.

Layout under ``<url>/<run>/``::

    base/                     config.json, generation_config.json, tokenizer files (written once)
    versions/<v:08d>/         manifest.json + model.safetensors (the served view of version v)
    POINTER                   {"version": v} — the newest durable version

Guarantees:

- a version's bytes are durable before the pointer names it (local: temp file + fsync + rename;
  object stores: the pointer object is written last and readers verify checksums);
- the pointer only moves forward (:meth:`Board.publish` refuses an older or equal version);
- a version directory is never rewritten once the pointer has passed it;
- :meth:`Board.load` verifies every tensor's xxh3-128 checksum against the manifest, so a reader
  never uses a torn or corrupted version.

Not covered yet: delta versions (sparse patches), squashed catch-up patches and retention; every
version is a full anchor of the served view.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import fsspec
import torch
import xxhash
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from policies.errors import BoardError, VersionCorrupt

BASE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
WEIGHTS = "model.safetensors"


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: str
    shape: list[int]
    checksum: str


class Manifest(BaseModel):
    """What one version directory holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int
    kind: Literal["anchor", "delta"]
    base: int | None
    view: str
    codec: str
    tensors: dict[str, TensorEntry]
    digest: str
    bytes: int
    created_at: float


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's raw bytes (layout-independent: contiguous, native order)."""
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(raw.tobytes())


def state_digest(entries: Mapping[str, TensorEntry]) -> str:
    """Digest of a whole version: names, dtypes, shapes and checksums, in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(entries):
        e = entries[name]
        h.update(f"{name}|{e.dtype}|{e.shape}|{e.checksum}\n".encode())
    return h.hexdigest()


class Board:
    """One run's versions on an fsspec URL (a plain path means the local filesystem)."""

    def __init__(self, url: str, run: str) -> None:
        self.url = url
        self.run = run
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = f"{root.rstrip('/')}/{run}"
        self._local = self.fs.protocol in ("file", ("file", "local")) or "file" in self.fs.protocol

    # -- paths ----------------------------------------------------------------------------------
    def _vdir(self, version: int) -> str:
        return f"{self.root}/versions/{version:08d}"

    # -- writing --------------------------------------------------------------------------------
    def create(self, model_dir: Path) -> None:
        """Copy the static model files (config, tokenizer) into ``base/``; idempotent."""
        for name in BASE_FILES:
            src = model_dir / name
            if src.exists():
                self._write_atomic(f"{self.root}/base/{name}", src.read_bytes())

    def publish(
        self, version: int, view: Mapping[str, torch.Tensor], *, view_name: str
    ) -> Manifest:
        """Write version ``version`` as a full anchor, then move the pointer to it."""
        latest = self.latest()
        if latest is not None and version <= latest:
            raise BoardError(f"pointer only moves forward: version {version} <= current {latest}")
        tensors = {k: v.detach().contiguous().cpu() for k, v in view.items()}
        entries = {
            k: TensorEntry(
                dtype=str(t.dtype).removeprefix("torch."),
                shape=list(t.shape),
                checksum=tensor_checksum(t),
            )
            for k, t in tensors.items()
        }
        payload = st_save(tensors)
        manifest = Manifest(
            version=version,
            kind="anchor",
            base=None,
            view=view_name,
            codec="safetensors",
            tensors=entries,
            digest=state_digest(entries),
            bytes=len(payload),
            created_at=time.time(),
        )
        vdir = self._vdir(version)
        self._write_atomic(f"{vdir}/{WEIGHTS}", payload)
        self._write_atomic(f"{vdir}/manifest.json", manifest.model_dump_json(indent=1).encode())
        self._write_atomic(f"{self.root}/POINTER", json.dumps({"version": version}).encode())
        return manifest

    def _write_atomic(self, path: str, data: bytes) -> None:
        if self._local:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dfd = os.open(Path(path).parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        else:
            # Object stores publish an object atomically on close; readers verify checksums.
            with self.fs.open(path, "wb") as f:
                f.write(data)

    # -- reading --------------------------------------------------------------------------------
    def latest(self) -> int | None:
        """The version the pointer names, or None before the first publish."""
        try:
            with self.fs.open(f"{self.root}/POINTER", "rb") as f:
                return int(json.loads(f.read())["version"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError) as exc:
            raise BoardError(f"{self.url}/{self.run}/POINTER is unreadable: {exc}") from exc

    def versions(self) -> list[int]:
        """Every version directory that has a manifest, ascending."""
        try:
            names = self.fs.ls(f"{self.root}/versions", detail=False)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            base = str(name).rstrip("/").rsplit("/", 1)[-1]
            if base.isdigit() and self.fs.exists(f"{name}/manifest.json"):
                out.append(int(base))
        return sorted(out)

    def manifest(self, version: int) -> Manifest:
        try:
            with self.fs.open(f"{self._vdir(version)}/manifest.json", "rb") as f:
                return Manifest.model_validate_json(f.read())
        except FileNotFoundError:
            raise BoardError(
                f"version {version} is not on the board {self.url}/{self.run}"
            ) from None

    def load(self, version: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """Read version ``version``'s served view and verify it against its manifest."""
        manifest = self.manifest(version)
        with self.fs.open(f"{self._vdir(version)}/{WEIGHTS}", "rb") as f:
            payload = f.read()
        try:
            tensors = st_load(payload)
        except Exception as exc:  # safetensors raises its own untyped errors on torn files
            raise VersionCorrupt(f"version {version}: weights unreadable: {exc}") from exc
        if set(tensors) != set(manifest.tensors):
            raise VersionCorrupt(f"version {version}: tensor names differ from the manifest")
        for name, entry in manifest.tensors.items():
            if tensor_checksum(tensors[name]) != entry.checksum:
                raise VersionCorrupt(f"version {version}: checksum mismatch for {name}")
        return manifest, tensors

    def read_base(self, name: str) -> bytes:
        with self.fs.open(f"{self.root}/base/{name}", "rb") as f:
            data: bytes = f.read()
            return data

    def materialize(self, version: int, out: Path) -> Path:
        """Write an HF checkpoint directory of ``version`` (static files + served weights)."""
        out.mkdir(parents=True, exist_ok=True)
        for name in BASE_FILES:
            try:
                (out / name).write_bytes(self.read_base(name))
            except FileNotFoundError:
                continue
        _, tensors = self.load(version)
        (out / WEIGHTS).write_bytes(st_save(tensors))
        return out
