"""Served views and the bitwise sparse patch codec.

Public surface (lazily imported): :func:`encode_patch`, :func:`apply_patch`, :func:`squash`,
:func:`read_patch_header`, :class:`PatchHeader`, :class:`TensorRecord`, ``CODEC``,
:func:`state_digest`, :func:`checksums`, :func:`tensor_checksum`.

Modules: :mod:`~policies.codec.encode` (the format's spec, and encoding),
:mod:`~policies.codec.apply` (applying, verified or not), :mod:`~policies.codec.format` (frame and
header), :mod:`~policies.codec.ops` (sections; vectorized numpy reference alongside),
:mod:`~policies.codec.changes` (the scan a section is written from),
:mod:`~policies.codec.kernels` (how the numba loops are compiled, their unit arithmetic),
:mod:`~policies.codec.kernels_scan` (the change scan), :mod:`~policies.codec.kernels_encode`
(the encoder's writers), :mod:`~policies.codec.kernels_apply` (the decoder),
:mod:`~policies.codec.scan` (the change scan in torch, on a device tensor's own device),
:mod:`~policies.codec.workers` (the codec's threads, an encode and an apply pool per process),
:mod:`~policies.codec.views` (bf16 / fp8 / int4 / nvfp4 served views),
:mod:`~policies.codec.digests` (per-tensor checksums, whole-state digests).
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
