"""Bringing a view to a version: catch-up plans, patches applied (whole, streamed in chunks, or a
sharded version's per rank) and anchors, every step verified.

:class:`BoardReader` is everything a reader (a sidecar, ``orchestrate versions``,
``materialize``) does with a board; it reads through :class:`~policies.board.index.BoardIndex`,
and :class:`policies.board.Board` adds publishing and retention. The layout and the guarantees
are in :mod:`policies.board`; sharded versions are read into the same full view
(:mod:`policies.board.sharded_read`). A patch that fails verification here is remembered and
routed around by this reader's later plans (a squashed patch or an anchor).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import structlog
import torch

from policies.board import plan as board_plan
from policies.board.anchors import anchor_payload, read_anchor
from policies.board.index import BoardIndex
from policies.board.sharded_read import apply_sharded, view_checksums
from policies.board.stream import (
    StagedChunk,
    StreamSource,
    apply_frame,
    check_chunks,
    chunk_ref,
    fetching,
    follow,
    sum_checksums,
)
from policies.board.types import (
    WEIGHTS,
    BoardOptions,
    CatchUp,
    Manifest,
    PatchRef,
    Step,
    Stream,
    chunk_file,
)
from policies.codec.written import current as current_written
from policies.errors import BoardError, PatchBaseCorrupt, PatchBaseMismatch, VersionCorrupt

log = structlog.get_logger(__name__)


class BoardReader(BoardIndex):
    """One run's versions, read into views (the arguments are :class:`BoardIndex`'s)."""

    def __init__(
        self,
        url: str,
        run: str,
        *,
        options: BoardOptions | None = None,
        storage_options: Mapping[str, object] | None = None,
        **fields: int | float | None,
    ) -> None:
        super().__init__(url, run, options=options, storage_options=storage_options, **fields)
        self._bad_patches: set[tuple[int, str]] = set()

    def catch_up(self, have: int | None, want: int | None = None) -> CatchUp:
        """The patches (or anchor + patches) that take a view at ``have`` to ``want``.

        ``want`` defaults to the newest version; ``have=None`` means the reader holds nothing.
        A direct patch route is searched only when ``have`` is at most ``4 · 2**catchup_levels``
        versions behind (else the plan starts at an anchor).
        """
        return self._catch_up(have, want, self.latest())

    def _catch_up(self, have: int | None, want: int | None, latest: int | None) -> CatchUp:
        """:meth:`catch_up` with the pointer read as ``latest`` (a distant board's round trip
        is not paid again)."""
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
        for v in reversed([v for v in self._published(latest) if v <= want]):
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

        ``want`` may also be a version a publisher is streaming from ``have``
        (:meth:`stream`): its chunks are applied as they land, and this returns once it is
        published and they match its manifest (:mod:`policies.board.stream`).
        """
        latest = self._seen_latest
        if want is None or latest is None or want > latest:
            # else ``want`` is published: the pointer was seen at or past it and never moves
            # back, so a distant board is not asked again (a caller just read it)
            if have is not None and want is not None:
                latest, stream = self.latest_and_stream()
                if want > (latest or -1):
                    return self._advance_streamed(view, have, want, stream, verify_base=verify_base)
            else:
                latest = self.latest()
        plan = self._catch_up(have, want, latest)
        self.check_base(self.manifest(plan.want))
        digest: str | None = None
        if plan.anchor is not None:
            fresh = read_anchor(self, self.manifest(plan.anchor))
            view.clear()
            view.update(fresh)
            if (written := current_written()) is not None:
                written.whole(fresh)
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

    def _advance_streamed(
        self,
        view: MutableMapping[str, torch.Tensor],
        have: int,
        want: int,
        stream: Stream | None,
        *,
        verify_base: bool,
    ) -> Manifest:
        """:meth:`advance` to ``want`` while ``stream`` (the run's ``STREAM``, read with the
        pointer that is still below ``want``) streams it (or refuse: not published)."""
        where = f"{self.safe_url}/{self.run}"
        if stream is None or stream.version != want or have not in stream.bases:
            raise BoardError(f"version {want} is not published on {where} (newest: {have})")
        held = self.manifest(have)
        if verify_base:
            self._check_digest(view, held)
        if held.digest != stream.bases[have]:
            raise PatchBaseMismatch(
                f"version {want} is streamed from {have} with digest {stream.bases[have]}; "
                f"version {have} has digest {held.digest}"
            )
        source = StreamSource(chunk=self.chunk_reader(want), stream=self.stream, latest=self.latest)
        staged = follow(
            view,
            have,
            stream,
            source,
            where=where,
            base_checksums=sum_checksums(held),
            on_commit=lambda: self.manifest(want),  # read while the last chunks are applied
        )
        target = self.manifest(want)
        self.check_base(target)
        ref = next((p for p in target.patches if p.base == have and p.chunks), None)
        wrong = "no streamed patch from it" if ref is None else check_chunks(target, ref, staged)
        if wrong is None and set(view) != set(target.tensors):
            wrong = "the view's tensor names differ from the manifest"
        if wrong is not None:
            raise BoardError(
                f"version {want} on {where} was published, but not as staged from {have}: {wrong}"
            )
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
        m = self.manifest(step.version)
        if m.shards:
            return apply_sharded(self, view, step, digest, m)
        ref = next(p for p in m.patches if p.base == step.base)
        if ref.chunks:
            return self._apply_chunks(view, step, digest, m, ref)
        data = self.read_patch(step)
        where = f"version {step.version}: {step.file}"
        apply_frame(view, data, where, digest, m.digest, self._base_checksums(step.base))
        return m.digest

    def _apply_chunks(
        self,
        view: MutableMapping[str, torch.Tensor],
        step: Step,
        digest: str | None,
        m: Manifest,
        ref: PatchRef,
    ) -> str:
        """Apply a streamed patch of a published version, chunk by chunk, each verified."""
        if digest is not None and ref.base_digest != digest:
            raise PatchBaseMismatch(
                f"version {step.version}: {step.file} applies to version {step.base} (digest "
                f"{ref.base_digest}); the view held has digest {digest}: catch up from the "
                "version actually held"
            )
        staged: list[StagedChunk] = []
        sums = self._base_checksums(step.base)
        sizes = [c.bytes for c in ref.chunks]

        def fetch(i: int) -> bytes:
            return self.read_exact(step.version, chunk_file(step.base, i), sizes[i])

        with fetching(fetch, sizes) as chunks:  # the next ones cross while one is applied
            for i, data in enumerate(chunks):
                # the first chunk vouches for nothing unless the caller did: hash the base once
                where = f"version {step.version}: {chunk_file(step.base, i)}"
                try:
                    staged.append(apply_frame(view, data, where, digest, base_checksums=sums))
                except PatchBaseCorrupt:
                    # the view held, or a chunk in another's place (one of its tensors applied
                    # twice): only the latter is the file's fault
                    if chunk_ref(data) != ref.chunks[i]:
                        raise VersionCorrupt(
                            f"{where}: not the chunk its manifest records"
                        ) from None
                    raise
                digest = ref.base_digest
        wrong = check_chunks(m, ref, staged)
        if wrong is not None:
            raise VersionCorrupt(f"version {step.version}: {wrong}")
        return m.digest

    def _base_checksums(self, base: int) -> dict[str, str] | None:
        """The ``sum-128`` checksums of version ``base`` (None: not such, or collected)."""
        try:
            return sum_checksums(self.manifest(base))
        except BoardError:
            return None

    def _check_digest(self, view: Mapping[str, torch.Tensor], m: Manifest) -> None:
        sums = view_checksums(view, m)
        if any(sums.get(k) != e.checksum for k, e in m.tensors.items()):
            raise VersionCorrupt(f"version {m.version}: the view does not match its manifest")

    def load(self, version: int) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """The full served view of ``version`` (anchor + patches), verified; a fresh copy."""
        view: dict[str, torch.Tensor] = {}
        return self.advance(view, None, version), view

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
            base = self.base_files()  # read first: the version is refused unless it records them
            _, tensors = self.load(version)
            files = {**base, WEIGHTS: anchor_payload(tensors)[0]}
            try:
                for name, data in files.items():
                    (tmp / name).write_bytes(data)
                if not out.exists():
                    tmp.rename(out)
                    return out
                for f in tmp.iterdir():
                    f.replace(out / f.name)
            except OSError as exc:  # a full disk, a quota: the write's error names no file
                raise BoardError(f"cannot write {out}: {exc.strerror or exc}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out
