"""The ``sum-128`` tensor checksum: what it catches, and a patch verified from the words it writes
equals a full check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from policies.codec import apply_patch, checksums, encode_patch, read_patch_header
from policies.codec import encode as codec_encode
from policies.codec.changes import JOB_UNITS
from policies.codec.digests import hex_lanes, lanes_hex, tensor_checksum
from policies.codec.format import FORMAT
from policies.codec.kernels_sum import scatter_summing
from policies.errors import PatchChecksumMismatch, PatchCorrupt

DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.complex128]


def _tensor(raw: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if raw.size == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.uint8).view(dtype)


@st.composite
def changed_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A base of random bytes (any length in elements: words short at the end included) and a
    target whose elements differ at a drawn density (single units up to whole runs)."""
    dtype = draw(st.sampled_from(DTYPES))
    size = torch.empty(0, dtype=dtype).element_size()
    n = draw(st.integers(0, 300))
    base = draw(hnp.arrays(np.uint8, n * size))
    new = draw(hnp.arrays(np.uint8, n * size))
    density = draw(st.sampled_from([0.005, 0.01, 0.03, 0.3, 1.0]))  # ≤ 4%: from the words
    keep = draw(hnp.arrays(np.float64, n, elements=st.floats(0, 1))) < density
    mask = np.repeat(keep, size)
    return _tensor(base, dtype), _tensor(np.where(mask, new, base), dtype)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changed_pairs(), st.sampled_from([8, 64, 1 << 16]))
def test_a_patch_checked_from_the_words_it_writes_passes_exactly_when_the_result_is_the_target(
    pair: tuple[torch.Tensor, torch.Tensor], chunk: int
) -> None:
    base, target = pair
    patch = encode_patch({"w": base}, {"w": target}, chunk=chunk)
    view = {"w": base.clone()}
    out = apply_patch(view, patch, base_checksums=checksums({"w": base}))
    assert torch.equal(out["w"].reshape(-1).view(torch.uint8), target.reshape(-1).view(torch.uint8))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changed_pairs(), st.sampled_from([8, 64, 1 << 16]))
def test_the_checksums_the_scan_sums_are_those_of_the_whole_targets(
    pair: tuple[torch.Tensor, torch.Tensor], chunk: int
) -> None:
    base, target = pair
    patch = encode_patch({"w": base}, {"w": target}, chunk=chunk)
    sums = checksums({"w": target})
    assert read_patch_header(patch).checksums == sums
    # told the checksums, the scan skips summing them and makes the same patch
    assert encode_patch({"w": base}, {"w": target}, chunk=chunk, target_checksums=sums) == patch


def test_a_tensor_scanned_by_several_jobs_is_summed_whole() -> None:
    """Past ``JOB_UNITS`` a tensor's scan is cut into jobs on the codec's threads; their sums
    add up to the tensor's checksum (an odd byte count: a short last word too)."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(0, 256, (3 * JOB_UNITS + 5,), dtype=torch.uint8, generator=gen)
    target = base.clone()
    target[:: 1 << 12] ^= 1
    patch = encode_patch({"w": base, "tied": base}, {"w": target, "tied": target})
    header = read_patch_header(patch)
    assert header.checksums == {"w": tensor_checksum(target), "tied": tensor_checksum(target)}
    known = encode_patch(
        {"w": base, "tied": base}, {"w": target, "tied": target}, target_checksums=header.checksums
    )
    assert known == patch  # the jobs skip summing what the caller knows


def test_changes_bunched_into_bitmask_and_dense_chunks_are_checked_from_the_words_written() -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(64 * 1024, generator=gen).to(torch.bfloat16)
    target = base.clone()
    bits = target.view(torch.int16)
    bits[1000:1600] ^= 1  # a dense chunk
    bits[9000:9400:3] ^= 2  # a bitmask chunk
    bits[20000::911] ^= 4  # sparse
    assert (bits != base.view(torch.int16)).float().mean() < 0.04
    patch = encode_patch({"w": base}, {"w": target}, chunk=256)
    out = apply_patch({"w": base.clone()}, patch, base_checksums=checksums({"w": base}))
    assert torch.equal(out["w"].view(torch.int16), bits)
    wrong = encode_patch(
        {"w": base}, {"w": target}, chunk=256, target_checksums=checksums({"w": base})
    )
    with pytest.raises(PatchChecksumMismatch):
        apply_patch({"w": base.clone()}, wrong, base_checksums=checksums({"w": base}))


def test_a_patch_that_misses_a_change_fails_the_check_made_from_the_words_written() -> None:
    """The publisher's checksum is of the whole target, not of the changes its scan found: a
    patch that leaves one change out fails the reader's check."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    target = base.clone()
    bits = target.view(torch.int16).reshape(-1)
    bits[::97] ^= 1
    missed = target.clone()
    missed.view(torch.int16).reshape(-1)[97 * 5] ^= 1  # back to the base's value
    patch = encode_patch({"w": base}, {"w": missed}, target_checksums=checksums({"w": target}))
    with pytest.raises(PatchChecksumMismatch, match="w: patched tensor checksum"):
        apply_patch({"w": base.clone()}, patch, base_checksums=checksums({"w": base}))


def test_a_change_to_any_byte_or_the_length_moves_the_checksum() -> None:
    gen = torch.Generator().manual_seed(1)
    t = torch.randint(0, 256, (77,), dtype=torch.uint8, generator=gen)
    seen = {tensor_checksum(t)}
    for i in range(t.numel()):
        for bit in (0, 7):
            moved = t.clone()
            moved[i] ^= 1 << bit
            seen.add(tensor_checksum(moved))
    assert len(seen) == 1 + 2 * t.numel()
    padded = torch.cat([t, torch.zeros(3, dtype=torch.uint8)])  # the same zero-padded last word
    assert tensor_checksum(padded) != tensor_checksum(t)
    assert tensor_checksum(torch.empty(0, dtype=torch.uint8)) != tensor_checksum(
        torch.zeros(8, dtype=torch.uint8)
    )


def test_a_checksum_reads_the_tensor_bytes_whatever_their_layout_or_alignment() -> None:
    gen = torch.Generator().manual_seed(2)
    t = torch.randn(33, 17, generator=gen)
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())
    raw = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=gen)
    assert tensor_checksum(raw[3:]) == tensor_checksum(raw[3:].clone())  # not 8-byte aligned


def test_lanes_and_hex_round_trip() -> None:
    t = torch.arange(10, dtype=torch.float32)
    h = tensor_checksum(t)
    lanes = hex_lanes(h)
    assert lanes is not None
    assert lanes_hex(lanes) == h
    assert hex_lanes("not a checksum") is None


def test_a_patch_of_another_format_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"w": torch.zeros(16)}
    header = read_patch_header(encode_patch(base, {"w": torch.ones(16)}))
    assert header.format == FORMAT
    assert header.checksums["w"] == tensor_checksum(torch.ones(16))
    monkeypatch.setattr(codec_encode, "FORMAT", 1)
    with pytest.raises(
        PatchCorrupt, match=rf"unsupported patch format 1 \(this sprawl reads format {FORMAT}\)"
    ):
        read_patch_header(encode_patch(base, {"w": torch.ones(16)}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 2, 4, 8]), st.integers(0, 2000), st.integers(0, 2**32 - 1))
def test_changes_scattered_into_units_move_the_checksum_to_the_result_s(
    width: int, changes: int, seed: int
) -> None:
    """``scatter_summing`` (a device publisher's host copy) writes the changes and its lanes
    are the full checksum's, a word's changes split across its blocks of 512 included."""
    rng = np.random.default_rng(seed)
    n = 3000 // width + 1  # a short last word for most widths
    units = rng.integers(0, 256, n * width, dtype=np.uint8).view(f"<u{width}")
    at = np.unique(rng.integers(0, n, changes))
    at = np.unique(np.concatenate([at, np.arange(508, min(n, 516))]))  # across the 512 edge
    new = rng.integers(0, 256, at.size * width, dtype=np.uint8).view(f"<u{width}")
    expected = units.copy()
    expected[at] = new
    held = hex_lanes(tensor_checksum(torch.from_numpy(units.view(np.uint8).copy())))
    assert held is not None
    acc = np.zeros(2, dtype=np.uint64)
    scatter_summing(units, at.astype(np.int64), new, acc)
    assert np.array_equal(units, expected)
    assert lanes_hex(held + acc) == tensor_checksum(torch.from_numpy(expected.view(np.uint8)))
