"""The board's vocabulary: options, run names, the pointer, manifests and catch-up plans (no
I/O, no torch).

Importing this module is cheap (pydantic only), so the orchestrator's config can build
:class:`BoardOptions` without importing torch.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from policies.errors import BoardError

MAX_VERSION = 2**63 - 1
"""The largest version a board holds (an int64: engines and logs carry versions as int64)."""

FORMAT = 8
"""The one manifest format this sprawl writes and reads: the whole manifest sealed (base files,
patch names and sizes included), tensor and piece checksums ``sum-128``
(:mod:`policies.codec.digests`: a reader verifies a patch from the words it writes), patches of
the codec's format 3 (``sprawl-patch/3``: each record vouches for the base words it changes), a
sharded version's :attr:`Manifest.shards` and a streamed patch's :attr:`PatchRef.chunks` where
they apply. A manifest of another format is refused (:class:`policies.errors.BoardFormatError` says
how to proceed); the policy is in ``docs/board.md``."""


WEIGHTS = "model.safetensors"
"""An anchor's file in its version directory (a sharded anchor's, in each rank's)."""
MANIFEST = "manifest.json"
STREAM = "STREAM"
"""The run's :class:`Stream` object: the version being streamed now."""

BASE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""The static model files a run's ``base/`` may hold (``Board.create`` copies them)."""

MAX_BASE_FILE_BYTES = 256 * 2**20
"""Largest base file a reader accepts (tokenizers of big vocabularies are tens of MiB)."""
MAX_MANIFEST_BYTES = 64 * 2**20
"""Largest manifest a reader accepts (about 200 bytes per tensor)."""
MAX_POINTER_BYTES = 4096
"""Largest ``POINTER`` a reader accepts."""

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A run's name: one path segment of the board, so it can name neither a parent nor a subtree."""


def check_run_name(name: str) -> str:
    """``name`` if it is a valid run name (:data:`RUN_NAME`, no ``..``), else :class:`BoardError`
    naming it."""
    if not RUN_NAME.fullmatch(name) or ".." in name:
        shown = repr(name) if len(name) <= 80 else f"{name[:77]!r}…"
        raise BoardError(
            f"run name {shown} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, with no '..'"
        )
    return name


class BoardOptions(BaseModel):
    """How a publisher lays versions out on the board."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    anchor_every: int = Field(default=16, ge=1, le=1_000_000)
    """Write a full view (anchor) at least every this many versions (1: every version)."""
    anchor_fraction: float = Field(default=0.5, gt=0, le=100)
    """Also write an anchor once the delta bytes since the last anchor would exceed this fraction
    of a full view (a fresh reader then reads at most ``1 + fraction`` views' worth of bytes)."""
    catchup_levels: int = Field(default=4, ge=0, le=16)
    """Squashed catch-up patches spanning up to ``2**levels`` versions; a reader up to that many
    versions behind applies at most ``log2(k) + 1`` patches. The publisher keeps up to
    ``levels + 1`` views in memory."""
    retain_versions: int | None = Field(default=None, ge=1)
    """After each publish, drop versions no reader within this many versions of the newest can
    need (``Board.gc(latest - retain_versions + 1)``); None keeps every version."""
    zstd_level: int = Field(default=1, ge=1, le=22)
    """zstd level of patch sections."""


class Pointer(BaseModel):
    """The run's ``POINTER`` object: the newest durable version. Strict: a bool, a float, a
    string or an out-of-range number is a malformed pointer, never coerced to a version."""

    model_config = ConfigDict(frozen=True)
    version: StrictInt = Field(ge=0, le=MAX_VERSION)
    digest: str | None = None
    """Digest of the version's full state (as in its manifest); absent in hand-written pointers."""


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: str
    shape: list[int]
    checksum: str
    """``sum-128`` of the tensor's bytes; in a sharded version, the checksum of its pieces' records
    (:func:`policies.board.manifest.pieces_checksum`)."""


class FileEntry(BaseModel):
    """One base file as a version's manifest records it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bytes: int = Field(ge=0, le=MAX_BASE_FILE_BYTES)
    checksum: str
    """xxh3-128 of the file's bytes (:func:`policies.codec.digests.bytes_checksum`)."""


def shard_dir(rank: int) -> str:
    """The directory, inside a sharded version's directory, that holds rank ``rank``'s files."""
    return f"shards/{rank:05d}"


def patch_file(base: int) -> str:
    """The name of the patch ``base`` → v inside version v's directory."""
    return f"from-{base:08d}.patch"


def chunk_file(base: int, index: int) -> str:
    """The name of chunk ``index`` of the patch ``base`` → v inside version v's directory (a
    streamed patch): deterministic, so a reader can fetch chunk ``i``
    before the manifest exists."""
    return f"from-{base:08d}/{index:05d}.patch"


class ChunkRef(BaseModel):
    """One chunk of a streamed patch: a complete sprawl patch frame of some of the tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bytes: int = Field(ge=0)
    """The chunk file's exact size: a reader reads no more than this."""
    checksum: str
    """The chunk frame's own xxh3-128 (its last 16 bytes, hex): a reader that staged the chunk
    before the manifest existed checks it is the chunk the manifest vouches for."""


class PatchRef(BaseModel):
    """One patch stored in a version directory: ``base`` → this version, in the file
    :func:`patch_file` names (any other name, e.g. a path out of the directory, is refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    base: int = Field(ge=0, le=MAX_VERSION)
    file: str
    bytes: int = Field(ge=0)
    """The file's exact size: a reader reads no more than this."""
    changed: int
    units: int
    base_digest: str
    chunks: list[ChunkRef] = Field(default_factory=list)
    """A streamed patch: its chunks, in order, in the files
    :func:`chunk_file` names (``file`` is then the patch's name, not a file); ``bytes`` is
    their sum. Empty: the patch is the one file ``file``."""

    @model_validator(mode="after")
    def _file_is_the_layouts(self) -> PatchRef:
        if self.file != patch_file(self.base):
            shown = repr(self.file) if len(self.file) <= 80 else f"{self.file[:77]!r}…"
            raise ValueError(
                f"patch file name {shown} is not valid: the patch from version {self.base} is "
                f"{patch_file(self.base)!r} in the version's own directory"
            )
        return self

    @property
    def density(self) -> float:
        return self.changed / self.units if self.units else 0.0


class PieceEntry(BaseModel):
    """One rank's piece of a tensor: the box ``offset … offset + shape`` of the full tensor."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    offset: list[int]
    shape: list[int]
    checksum: str
    """The piece's ``sum-128`` checksum of its bytes (contiguous, native order)."""


class ShardEntry(BaseModel):
    """What one rank wrote into a sharded version (under :func:`shard_dir`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int = Field(ge=0)
    pieces: dict[str, PieceEntry]
    """The rank's piece of each tensor it publishes, by full tensor name (aliases excluded)."""
    digest: str
    """Digest of the pieces as a state (names, dtypes, piece shapes, checksums): the target
    digest of this rank's patches."""
    bytes: int = Field(default=0, ge=0)
    """Size of the rank's ``model.safetensors`` (anchors; 0 for a delta)."""
    patches: list[PatchRef] = Field(default_factory=list)
    """The rank's patches into this version, one per base of the manifest's ``patches``."""


class Stream(BaseModel):
    """The run's ``STREAM`` object: the version a publisher is streaming now (written before its
    first chunk). It never makes a version servable — only the manifest and the pointer do —;
    it tells readers which chunks to fetch while the rest is encoded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: StrictInt = Field(ge=0, le=MAX_VERSION)
    id: str
    """New for every publish attempt: a reader that sees another id stops following this one."""
    bases: dict[int, str]
    """The patches being streamed: base version → that version's digest."""
    chunks: list[list[str]]
    """The tensor names of each chunk, in order (every tensor of the version in exactly one)."""
    limits: list[int]
    """The largest size each chunk may have (a reader reads no more than that)."""

    @model_validator(mode="after")
    def _one_limit_per_chunk(self) -> Stream:
        if len(self.limits) != len(self.chunks):
            raise ValueError("limits must hold one size per chunk")
        return self


class Manifest(BaseModel):
    """What one version directory holds; written after its data files, before the pointer."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int
    kind: Literal["anchor", "delta"]
    base: int | None
    """The version the primary patch applies to (the previous version); None for an anchor."""
    view: str
    codec: str
    tensors: dict[str, TensorEntry]
    digest: str
    bytes: int
    """Bytes of the primary representation: the full view (anchor) or the delta patch."""
    created_at: float
    patches: list[PatchRef] = Field(default_factory=list)
    """Every patch into this version (the delta from ``base`` and squashed catch-up patches)."""
    aliases: dict[str, str] = Field(default_factory=dict)
    """Names stored once in the anchor file under another name (tied tensors)."""
    anchor: int | None = None
    """The newest anchor at or before this version (itself for an anchor)."""
    chain_bytes: int = 0
    """Delta bytes published since ``anchor`` (this version's included)."""
    full_bytes: int = 0
    """Bytes of the view's tensors (what an anchor of it stores)."""
    format: int = 1
    """The manifest format (:data:`FORMAT`); absent in manifests of format 1."""
    base_files: dict[str, FileEntry] = Field(default_factory=dict)
    """Every file in the run's ``base/`` when the version was published, by name."""
    shards: list[ShardEntry] = Field(default_factory=list)
    """A sharded version's pieces, one entry per rank in rank order; empty for a version
    published by one process. Each of ``patches``
    is then the sum of the ranks' patches from that base, and ``bytes`` the sum of theirs."""
    seal: str = ""
    """xxh3-128 of every other field (``policies.board.manifest.manifest_seal``): a changed patch
    name, size or base file record is caught like a changed tensor checksum."""

    @field_validator("base_files")
    @classmethod
    def _base_names(cls, v: dict[str, FileEntry]) -> dict[str, FileEntry]:
        unknown = sorted(set(v) - set(BASE_FILES))
        if unknown:
            raise ValueError(f"{unknown} are not base file names ({', '.join(BASE_FILES)})")
        return v

    @property
    def density(self) -> float | None:
        """Changed fraction of the view against the previous version (None if unknown)."""
        for p in self.patches:
            if p.base == self.base:
                return p.density
        return None


class Step(BaseModel):
    """Apply the patch ``file`` of ``version`` to a view at ``base``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    base: int
    version: int
    file: str
    bytes: int


class CatchUp(BaseModel):
    """How to go from the version a reader holds to the one it wants."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    have: int | None
    want: int
    anchor: int | None
    """Start from this anchor's full view (None: start from ``have``)."""
    anchor_bytes: int = 0
    steps: list[Step]

    @property
    def bytes(self) -> int:
        return self.anchor_bytes + sum(s.bytes for s in self.steps)
