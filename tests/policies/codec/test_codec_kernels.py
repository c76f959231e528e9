"""The compiled section writer and reader against the numpy reference of the wire format."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from policies.codec import ops
from policies.codec.changes import find_changes
from policies.codec.ops import (
    CODINGS,
    DENSE,
    SECTION,
    Coding,
    apply_section,
    encode_positions,
    encode_section,
    pick_coding,
    transform,
)


def _reference_section(b: np.ndarray, t: np.ndarray, chunk: int, coding: Coding) -> bytes:
    """The section the wire format specifies, built with the vectorized numpy reference."""
    pos = np.flatnonzero(b != t).astype(np.int64)
    enc = encode_positions(pos, b.size, chunk)
    at = [pos] if enc.sparse_sel is None else [pos[enc.sparse_sel], pos[enc.bitmask_sel]]
    at += [np.arange(c * chunk, min((c + 1) * chunk, b.size)) for c in enc.dense_chunks]
    idx = np.concatenate(at) if at else np.empty(0, dtype=np.int64)
    values = transform(b[idx], t[idx], coding)
    lens = [p.size for p in enc.gap_planes]
    head = SECTION.pack(CODINGS.index(coding), len(lens), values.size, enc.bitmasks.shape[0])
    planes = values.view(np.uint8).reshape(-1, b.itemsize).T
    parts = [enc.modes, *enc.gap_planes, enc.bitmasks.reshape(-1), planes.reshape(-1)]
    return head + struct.pack(f"<{len(lens)}Q", *lens) + b"".join(p.tobytes() for p in parts)


@st.composite
def unit_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """Base and target units of a drawn width, changed at a drawn density, and a chunk size."""
    dtype = np.dtype(f"<u{draw(st.sampled_from([1, 2, 4, 8]))}")
    chunk = draw(st.sampled_from([8, 16, 64, 256]))
    n = draw(st.integers(1, 5 * chunk + 7))
    base = draw(hnp.arrays(dtype, n))
    new = draw(hnp.arrays(dtype, n))
    density = draw(st.sampled_from([0.01, 0.1, 0.3, 0.8, 1.0]))
    keep = draw(hnp.arrays(np.float64, n, elements=st.floats(0, 1))) >= density
    return base, np.where(keep, base, new), chunk


@settings(max_examples=150, deadline=None)
@given(unit_pairs())
def test_compiled_sections_are_the_reference_layout(
    case: tuple[np.ndarray, np.ndarray, int],
) -> None:
    b, t, chunk = case
    changes = find_changes(b, t, chunk)
    assert changes.changed == int(np.count_nonzero(b != t))
    raw = encode_section(b, t, changes, b.dtype.itemsize > 1, chunk).tobytes()
    if not changes.changed:
        assert raw == b""
        return
    coding = CODINGS[raw[0]]
    assert raw == _reference_section(b, t, chunk, coding)


@settings(max_examples=90, deadline=None)
@given(unit_pairs(), st.sampled_from(CODINGS))
def test_compiled_sections_are_the_reference_layout_in_every_coding(
    case: tuple[np.ndarray, np.ndarray, int], coding: Coding
) -> None:
    """Each coding's compiled value loop (sparse, bitmask and dense chunks) stores the reference
    transform, whichever coding the data would have picked."""
    b, t, chunk = case
    changes = find_changes(b, t, chunk)
    if not changes.changed:
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "pick_coding", lambda *_: coding)
        raw = encode_section(b, t, changes, b.dtype.itemsize > 1, chunk).tobytes()
    assert raw == _reference_section(b, t, chunk, coding)


def _reference_bits(values: np.ndarray) -> float:
    """Order-0 entropy, in bits, of the byte planes of ``values`` (numpy only)."""
    total = 0.0
    for plane in values.view(np.uint8).reshape(-1, values.itemsize).T:
        counts = np.bincount(plane, minlength=256)
        p = counts[counts > 0] / plane.size
        total += float(-(p * np.log2(p)).sum() * plane.size)
    return total


@settings(max_examples=100, deadline=None)
@given(unit_pairs())
def test_the_coding_picked_has_the_fewest_entropy_bits_of_the_reference_transforms(
    case: tuple[np.ndarray, np.ndarray, int],
) -> None:
    """The compiled byte counts behind the pick stand for the reference transforms' bytes."""
    b, t, _ = case
    idx = np.flatnonzero(b != t)
    if not idx.size:
        return
    floating = b.dtype.itemsize > 1
    order: list[Coding] = ["delta", "odelta", "xor"] if floating else ["delta", "xor"]
    bits = {c: _reference_bits(transform(b[idx], t[idx], c)) for c in order}
    picked = pick_coding(b[idx], t[idx], floating)
    assert bits[picked] == pytest.approx(min(bits.values()), rel=1e-9, abs=1e-9)


@settings(max_examples=150, deadline=None)
@given(unit_pairs(), st.sampled_from(CODINGS))
def test_reference_sections_apply_in_every_coding(
    case: tuple[np.ndarray, np.ndarray, int], coding: Coding
) -> None:
    b, t, chunk = case
    if np.array_equal(b, t):
        return
    units = b.copy()
    apply_section(units, _reference_section(b, t, chunk, coding), chunk)
    assert np.array_equal(units, t)


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("density", [0.003, 0.1, 0.3])
def test_scattered_and_near_sequential_changes_apply_in_every_coding(
    coding: Coding, width: int, density: float
) -> None:
    """The apply takes one loop for changes several cache lines apart (0.3%) and another for
    changes every few units (10% in sparse chunks, 30% in bitmask chunks); both are exact."""
    rng = np.random.default_rng(width)
    dtype = np.dtype(f"<u{width}")
    b = rng.integers(0, np.iinfo(dtype).max, 1 << 17, dtype=dtype, endpoint=True)
    t = b.copy()
    at = rng.choice(b.size, int(b.size * density), replace=False)
    t[at] = rng.integers(0, np.iinfo(dtype).max, at.size, dtype=dtype, endpoint=True)
    units = b.copy()
    apply_section(units, _reference_section(b, t, 4096, coding), 4096)
    assert np.array_equal(units, t)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, (1 << 22) - 1), min_size=1, max_size=40, unique=True))
def test_long_gaps_take_three_or_more_varint_planes_as_the_reference(at: list[int]) -> None:
    """Gaps of 2**14 units or more need a third varint byte (small tensors never reach it)."""
    chunk = 1 << 21
    b = np.zeros((1 << 22) + 5, dtype=np.uint16)
    t = b.copy()
    t[at] = 1
    raw = encode_section(b, t, find_changes(b, t, chunk), True, chunk).tobytes()
    assert raw == _reference_section(b, t, chunk, CODINGS[raw[0]])
    units = b.copy()
    apply_section(units, raw, chunk)
    assert np.array_equal(units, t)


def test_a_gap_of_2_to_the_21_takes_four_varint_planes() -> None:
    b = np.zeros((1 << 22) + 5, dtype=np.uint16)
    t = b.copy()
    t[[3, 3 + (1 << 21) + 1]] = 1  # the second gap is 2**21: 22 bits, four 7-bit groups
    raw = encode_section(b, t, find_changes(b, t, 1 << 21), True, 1 << 21).tobytes()
    assert SECTION.unpack_from(raw)[1] == 4
    assert raw == _reference_section(b, t, 1 << 21, CODINGS[raw[0]])


def _section() -> tuple[np.ndarray, bytes, int]:
    """A section using sparse, bitmask and dense chunks (two gap planes)."""
    chunk = 256
    rng = np.random.default_rng(0)
    b = rng.integers(0, 2**16, 6 * chunk, dtype=np.uint16)
    t = b.copy()
    t[rng.choice(chunk, 3, replace=False)] += 1  # sparse, gaps ≥ 128 need a second byte
    t[chunk : 2 * chunk : 3] += 2  # bitmask
    t[2 * chunk : 3 * chunk] += 3  # dense
    t[-1] -= 1  # sparse again after unchanged chunks
    raw = encode_section(b, t, find_changes(b, t, chunk), True, chunk).tobytes()
    assert set(raw[SECTION.size + 16 : SECTION.size + 22]) == {0, 1, 2, DENSE}
    return b, raw, chunk


_B, _RAW, _CHUNK = _section()


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(_RAW) - 1), st.integers(1, 255))
def test_a_damaged_section_never_writes_out_of_place(i: int, flip: int) -> None:
    """Any byte changed: refused with nothing written, or applied inside the tensor."""
    bad = bytearray(_RAW)
    bad[i] ^= flip
    guard = np.zeros(3 * _B.size, dtype=np.uint16)
    guard[_B.size : 2 * _B.size] = _B
    units = guard[_B.size : 2 * _B.size]
    try:
        apply_section(units, bytes(bad), _CHUNK)
    except ValueError:
        assert np.array_equal(units, _B)
    assert not guard[: _B.size].any()
    assert not guard[2 * _B.size :].any()


@pytest.mark.parametrize("cut", [0, 5, SECTION.size + 3, -40, -1])
def test_a_truncated_section_is_refused(cut: int) -> None:
    units = _B.copy()
    with pytest.raises(ValueError, match=r"section|varint|bitmask|modes|planes|sparse"):
        apply_section(units, _RAW[:cut], _CHUNK)
    assert np.array_equal(units, _B)
