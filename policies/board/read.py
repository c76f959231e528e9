"""Reading the version board: the pointer, manifests, catch-up plans, verified views.

:class:`BoardReader` is everything a replica (a sidecar, ``orchestrate versions``,
``materialize``) does with a board; :class:`policies.board.Board` adds publishing and retention.
The layout and the guarantees are in :mod:`policies.board`.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import structlog
import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from policies.board import plan as board_plan
from policies.board.manifest import file_entries, one_line, parse_manifest
from policies.board.store import Store
from policies.board.types import (
    BASE_FILES,
    MAX_BASE_FILE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    BoardOptions,
    CatchUp,
    Manifest,
    Pointer,
    Step,
    check_run_name,
)
from policies.codec import apply_patch, read_patch_header
from policies.codec.digests import checksums, storage_key, tensor_checksum
from policies.errors import (
    BoardError,
    PatchBaseMismatch,
    PatchError,
    PointerMalformed,
    VersionCorrupt,
)

log = structlog.get_logger(__name__)

WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"


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


class BoardReader:
    """One run's versions on an fsspec URL (a plain path means the local filesystem), read.

    ``options`` (or its fields as keyword arguments) matter to a publisher, except
    ``catchup_levels``, which bounds how far back a direct patch route is searched.
    ``storage_options`` go to fsspec (e.g. ``{"client_kwargs": {"endpoint_url": …}}``).
    A ``run`` that is not a valid run name (:func:`~policies.board.types.check_run_name`, e.g.
    ``../..``) raises :class:`BoardError` naming it.
    """

    def __init__(
        self,
        url: str,
        run: str,
        *,
        options: BoardOptions | None = None,
        storage_options: Mapping[str, object] | None = None,
        **fields: int | float | None,
    ) -> None:
        self.url = url
        self.run = check_run_name(run)
        self.options = options or BoardOptions.model_validate(fields)
        self.store = Store(url, storage_options)
        self.safe_url = self.store.safe_url
        self.fs = self.store.fs
        self.root = f"{self.store.root}/{run}"
        self._manifests: dict[int, Manifest] = {}
        self._seen_latest: int | None = None
        self._bad_patches: set[tuple[int, str]] = set()
        self._base: dict[str, bytes] | None = None  # the base files this reader serves

    # -- storage edge ----------------------------------------------------------------------------
    def _vdir(self, version: int) -> str:
        return f"{self.root}/versions/{version:08d}"

    def _read(self, path: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of ``path`` (more than ``limit``: the object is larger)."""
        return self.store.read(path, limit)

    def latest(self) -> int | None:
        """The version the pointer names, or None before the first publish.

        A malformed pointer (not JSON, no ``version``, or one that is not an integer in
        ``0..MAX_VERSION``) raises :class:`PointerMalformed`; a watcher logs it and keeps what it
        has, and the next publish repairs it.
        """
        try:
            raw = self._read(f"{self.root}/POINTER", MAX_POINTER_BYTES)
        except FileNotFoundError:
            return None
        where = f"{self.safe_url}/{self.run}/POINTER"
        if len(raw) > MAX_POINTER_BYTES:
            raise PointerMalformed(f"{where} is malformed (larger than {MAX_POINTER_BYTES} bytes)")
        try:
            latest = Pointer.model_validate_json(raw).version
        except ValidationError as exc:
            raise PointerMalformed(f"{where} is malformed ({one_line(exc, 'pointer')})") from None
        self._seen_latest = latest
        return latest

    def versions(self) -> list[int]:
        """Every published version (a manifest at or below the pointer), ascending."""
        latest = self.latest()
        if latest is None:
            return []
        try:
            found = self.store.dirs_with(f"{self.root}/versions", MANIFEST)
        except FileNotFoundError:
            return []
        return sorted(int(d) for d in found if d.isdigit() and int(d) <= latest)

    def manifest(self, version: int) -> Manifest:
        """The manifest of ``version`` (cached once the pointer has passed it: immutable)."""
        cached = self._manifests.get(version)
        if cached is not None:
            return cached
        try:
            raw = self._read(f"{self._vdir(version)}/{MANIFEST}", MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise BoardError(
                f"version {version} is not on the board {self.safe_url}/{self.run}"
            ) from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise VersionCorrupt(
                f"version {version}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes"
            )
        m = parse_manifest(raw, version, f"{self.safe_url}/{self.run}")
        if self._seen_latest is not None and version <= self._seen_latest:
            self._manifests[version] = m
        return m

    def catch_up(self, have: int | None, want: int | None = None) -> CatchUp:
        """The patches (or anchor + patches) that take a view at ``have`` to ``want``.

        ``want`` defaults to the newest version; ``have=None`` means the replica holds nothing.
        A direct patch route is searched only when ``have`` is at most ``4 · 2**catchup_levels``
        versions behind (else the plan starts at an anchor).
        """
        latest = self.latest()
        want = latest if want is None else want
        if latest is None or want is None or want > latest:
            raise BoardError(
                f"version {want} is not published on {self.safe_url}/{self.run} (newest: {latest})"
            )
        if have == want:
            return CatchUp(have=have, want=want, anchor=None, steps=[])
        self.manifest(want)  # a version the pointer names without a manifest: say so
        horizon = 4 << self.options.catchup_levels
        direct = have is not None and have < want and want - have <= horizon
        manifests: dict[int, Manifest] = {}
        for v in reversed([v for v in self.versions() if v <= want]):
            found_anchor = any(m.kind == "anchor" for m in manifests.values())
            if found_anchor and (not direct or (have is not None and v <= have)):
                break
            manifests[v] = self._usable(self.manifest(v))
        route = board_plan.plan(manifests, have if direct else None, want)
        if route is None:
            raise BoardError(
                f"no route to version {want} from {have}: no anchor at or before it on "
                f"{self.safe_url}/{self.run}"
            )
        return CatchUp(
            have=have,
            want=want,
            anchor=route.anchor,
            anchor_bytes=route.anchor_bytes,
            steps=route.steps,
        )

    def _usable(self, m: Manifest) -> Manifest:
        """``m`` without the patches that failed verification here (plans route around them)."""
        bad = [p for p in m.patches if (m.version, p.file) in self._bad_patches]
        if not bad:
            return m
        return m.model_copy(update={"patches": [p for p in m.patches if p not in bad]})

    def read_patch(self, step: Step) -> bytes:
        """The bytes of one planned patch (verify them by applying with :meth:`advance`); no
        more than the manifest's size of it is read."""
        try:
            data = self._read(f"{self._vdir(step.version)}/{step.file}", step.bytes)
        except FileNotFoundError:
            raise VersionCorrupt(f"version {step.version}: {step.file} is missing") from None
        if len(data) != step.bytes:
            held = f"more than {step.bytes}" if len(data) > step.bytes else str(len(data))
            raise VersionCorrupt(
                f"version {step.version}: {step.file} holds {held} bytes, its manifest records "
                f"{step.bytes} (damaged or truncated)"
            )
        return data

    def advance(
        self,
        view: MutableMapping[str, torch.Tensor],
        have: int | None,
        want: int | None = None,
        *,
        verify_base: bool = False,
    ) -> Manifest:
        """Bring ``view`` (holding ``have``, or nothing) to ``want`` in place; its manifest.

        Patches are applied bitwise into ``view``'s tensors; an anchor in the plan replaces the
        contents. ``verify_base`` hashes the held view instead of trusting that it is ``have``.
        If this raises, ``view`` may be partly advanced: reload it (``have=None``).
        """
        plan = self.catch_up(have, want)
        self._check_base(self.manifest(plan.want))
        digest: str | None = None
        if plan.anchor is not None:
            fresh = self._read_anchor(self.manifest(plan.anchor))
            view.clear()
            view.update(fresh)
            digest = self.manifest(plan.anchor).digest
        elif have is not None and not verify_base:
            try:
                digest = self.manifest(have).digest
            except BoardError:
                digest = None  # retired by gc: hash the view instead
        for step in plan.steps:
            digest = self._apply(view, step, digest)
        target = self.manifest(plan.want)
        if set(view) != set(target.tensors):
            raise VersionCorrupt(f"version {plan.want}: tensor names differ from the manifest")
        if plan.want == have and verify_base:
            self._check_digest(view, target)
        return target

    def _apply(
        self, view: MutableMapping[str, torch.Tensor], step: Step, digest: str | None
    ) -> str:
        try:
            return self._apply_verified(view, step, digest)
        except VersionCorrupt:
            # the file itself is wrong (damaged, truncated, or another version's patch): later
            # plans from this reader avoid it (squashed patches or an anchor route around it)
            self._bad_patches.add((step.version, step.file))
            raise

    def _apply_verified(
        self, view: MutableMapping[str, torch.Tensor], step: Step, digest: str | None
    ) -> str:
        data = self.read_patch(step)
        m = self.manifest(step.version)
        where = f"version {step.version}: {step.file}"
        try:
            hdr = read_patch_header(data)
            if hdr.target_digest != m.digest:
                raise VersionCorrupt(
                    f"{where} makes {hdr.target_digest}, the manifest says {m.digest}"
                )
            if digest is not None and hdr.base_digest != digest:
                raise PatchBaseMismatch(
                    f"{where} applies to version {step.base} (digest {hdr.base_digest}); the view "
                    f"held has digest {digest}: catch up from the version actually held"
                )
            apply_patch(view, data, base_digest=digest, verify=True)
        except PatchBaseMismatch as exc:
            raise PatchBaseMismatch(str(exc) if where in str(exc) else f"{where}: {exc}") from None
        except PatchError as exc:
            raise VersionCorrupt(f"{where}: {exc}") from None
        return m.digest

    def _check_digest(self, view: Mapping[str, torch.Tensor], m: Manifest) -> None:
        sums = checksums(view)
        if any(sums.get(k) != e.checksum for k, e in m.tensors.items()):
            raise VersionCorrupt(f"version {m.version}: the view does not match its manifest")

    def _read_anchor(self, m: Manifest) -> dict[str, torch.Tensor]:
        try:
            payload = self._read(f"{self._vdir(m.version)}/{WEIGHTS}", m.bytes)
        except FileNotFoundError:
            raise VersionCorrupt(f"version {m.version}: {WEIGHTS} is missing") from None
        if len(payload) != m.bytes:
            held = f"more than {m.bytes}" if len(payload) > m.bytes else str(len(payload))
            raise VersionCorrupt(
                f"version {m.version}: weights unreadable: {WEIGHTS} holds {held} bytes, its "
                f"manifest records {m.bytes}"
            )
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

    def load(self, version: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """The full served view of ``version`` (anchor + patches), verified; a fresh copy."""
        view: dict[str, torch.Tensor] = {}
        return self.advance(view, None, version), view

    def base_files(self) -> dict[str, bytes]:
        """The run's base files (config, tokenizer: :data:`BASE_FILES` present in ``base/``),
        read once per reader; what a replica writes next to the weights it serves.

        From then on every version this reader loads or advances to must record exactly these
        files (names, sizes, checksums) in its manifest: :meth:`advance` refuses any other with
        :class:`VersionCorrupt` naming the file, so a replica never serves weights under base
        files that were not published with them. A file larger than ``MAX_BASE_FILE_BYTES`` is
        a :class:`BoardError` naming it.
        """
        if self._base is None:
            files: dict[str, bytes] = {}
            for name in BASE_FILES:
                try:
                    data = self._read(f"{self.root}/base/{name}", MAX_BASE_FILE_BYTES)
                except FileNotFoundError:
                    continue
                if len(data) > MAX_BASE_FILE_BYTES:
                    raise BoardError(
                        f"base/{name} on {self.safe_url}/{self.run} is larger than "
                        f"{MAX_BASE_FILE_BYTES} bytes"
                    )
                files[name] = data
            self._base = files
        return dict(self._base)

    def _check_base(self, m: Manifest) -> None:
        """Refuse ``m`` unless it records the base files this reader read (if it read any)."""
        if self._base is None:
            return
        held = file_entries(self._base)
        for name in sorted(set(held) | set(m.base_files)):
            recorded, have = m.base_files.get(name), held.get(name)
            if recorded == have:
                continue
            if recorded is None:
                why = "is not recorded in its manifest (written after the version was published)"
            elif have is None:
                why = "is recorded in its manifest but missing from the board"
            else:
                why = (
                    f"does not match its manifest ({have.bytes} bytes, checksum {have.checksum}; "
                    f"the manifest records {recorded.bytes} bytes, checksum {recorded.checksum})"
                )
            raise VersionCorrupt(f"version {m.version}: base file base/{name} {why}")

    def materialize(self, version: int, out: Path) -> Path:
        """Write an HF checkpoint dir of ``version``, bit-identical to an anchor of it.

        All or nothing: the files are written to a temporary sibling of ``out`` and renamed into
        place only once every one is written (a new ``out`` is one rename; into an existing
        directory, each file is one rename and other files there are left alone). If this raises,
        ``out`` is as it was and the temporary directory is gone.
        """
        if out.exists() and not out.is_dir():
            raise BoardError(f"{out} exists and is not a directory")
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as exc:
            raise BoardError(f"cannot write {out}: {exc.strerror or exc}") from None
        try:
            for name, data in self.base_files().items():
                (tmp / name).write_bytes(data)
            _, tensors = self.load(version)  # refused unless it records these base files
            (tmp / WEIGHTS).write_bytes(anchor_payload(tensors)[0])
            if not out.exists():
                tmp.rename(out)
                return out
            for f in tmp.iterdir():
                f.replace(out / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out
