"""A section read without its tensor (policies.codec.sections): positions, stored values and the
values they make equal what the compiled decoder writes, and the checksum moved by them alone
(kernels_read.read_changes) is the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.codec import apply_patch, encode_patch
from policies.codec.digests import hex_lanes, lanes_hex, tensor_checksum
from policies.codec.format import parse_patch
from policies.codec.kernels_read import read_changes
from policies.codec.ops import CODINGS, transform
from policies.codec.sections import section_values, untransform


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_untransform_inverts_every_coding_bit_for_bit(coding: str, dtype: type) -> None:
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    b = rng.integers(0, info.max, 4096, dtype=dtype, endpoint=True)
    t = rng.integers(0, info.max, 4096, dtype=dtype, endpoint=True)
    t[:2048] = b[:2048] ^ dtype(1)  # Adam-sized steps as well as arbitrary ones
    assert np.array_equal(untransform(b, transform(b, t, coding), coding), t)  # type: ignore[arg-type]


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    density=st.sampled_from([0.002, 0.05, 0.4, 1.0]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int8]),
)
def test_a_section_read_without_its_tensor_makes_the_target(
    seed: int, density: float, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(257, 33, generator=g) * 4).to(dtype)
    target = base.clone()
    bits = target.reshape(-1).view(torch.uint8 if dtype == torch.int8 else torch.int16)
    hit = torch.rand(bits.numel(), generator=g) < density
    bits[hit] ^= 1
    patch = encode_patch({"w": base}, {"w": target}, chunk=256)
    header, body = parse_patch(patch)
    rec = header.tensors[0]
    if not rec.length:
        return
    data = zstandard.ZstdDecompressor().decompress(body[rec.offset : rec.offset + rec.length])
    positions, coding, z = section_values(data, rec.units, header.chunk, rec.width)
    b = base.reshape(-1).view(torch.uint8).numpy().view(f"<u{rec.width}")
    t = target.reshape(-1).view(torch.uint8).numpy().view(f"<u{rec.width}")
    assert np.array_equal(untransform(b[positions], z, coding), t[positions])
    applied = {"w": base.clone()}
    apply_patch(applied, patch)
    assert torch.equal(applied["w"], target)  # what the positions leave out did not change
    order = np.argsort(positions)
    positions, new = positions[order], t[positions[order]]
    lanes = hex_lanes(tensor_checksum(base))
    assert lanes is not None
    n = positions.size
    old64, new64 = np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.uint64)
    z64 = z[order].astype(np.uint64)
    olds = np.zeros(3, dtype=np.uint64)
    at = positions.astype(np.uint64)
    read_changes(b, at, z64, CODINGS.index(coding), old64, new64, lanes, olds)
    assert np.array_equal(new64.astype(b.dtype), new)  # the compiled read makes the same values
    assert lanes_hex(lanes) == rec.checksum
    assert lanes_hex(olds[:2]) == rec.old_words  # the base words it changes, as the encoder saw
    assert torch.equal(base.reshape(-1).view(torch.uint8), torch.from_numpy(b.view(np.uint8)))
    assert rec.checksum == tensor_checksum(target)
