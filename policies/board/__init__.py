"""The board: immutable versions and one monotonic pointer per run, on any fsspec URL.

Public surface (lazily imported, so ``policies.board.types`` stays torch-free):
:class:`Board` (the publisher), :class:`ShardedPublisher` (every rank of a distributed trainer
publishes its shard), :class:`BoardReader`, :class:`BoardOptions`, :class:`Manifest`,
:class:`CatchUp`, :class:`PatchRef`, :class:`Step`, :class:`TensorEntry`, ``BASE_FILES``,
``WEIGHTS``, ``MANIFEST``, :func:`anchor_payload`, :func:`redact`.

Modules: :mod:`~policies.board.publish` (writing versions), :mod:`~policies.board.host` (the host
copy a publisher writes from, and its patches), :mod:`~policies.board.read` (views brought to
versions: catch-up, materializing), :mod:`~policies.board.index` (the pointer, manifests and files
as bytes), :mod:`~policies.board.anchors` (an anchor's bytes), :mod:`~policies.board.sharded`
(sharded versions and their commit protocol), :mod:`~policies.board.sharded_layout` (a rank's
pieces of a sharded version and the manifest assembled from every rank's),
:mod:`~policies.board.sharded_read` (a sharded version read into the full view),
:mod:`~policies.board.stream_publish` (patches written chunk by chunk),
:mod:`~policies.board.stream` (a reader staging them as they land), :mod:`~policies.board.plan`
(which patches and anchors, pure), :mod:`~policies.board.manifest` (a manifest's digest, seal
and base-file records),
:mod:`~policies.board.store` (the fsspec store), :mod:`~policies.board.types` (manifests and
options), :mod:`~policies.board.cli` (``orchestrate versions`` / ``materialize``),
:mod:`~policies.board.failpoints` (fault injection for the chaos harness, inert by default).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
