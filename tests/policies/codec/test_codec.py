"""The bitwise patch codec: exact round trips, position regimes, integrity and chains."""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import signal

import numpy as np
import pytest
import structlog
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from structlog.testing import capture_logs

from orchestrator.bench import codec as bench_codec
from policies.codec import (
    apply_patch,
    checksums,
    encode_patch,
    read_patch_header,
    squash,
    state_digest,
)
from policies.codec.ops import (
    BITMASK,
    DENSE,
    SPARSE,
    decode_positions,
    encode_positions,
    varint_planes,
    varint_values,
)
from policies.errors import PatchBaseMismatch, PatchChecksumMismatch, PatchCorrupt
from tests.support.boards import adam_like_step

State = dict[str, torch.Tensor]

DTYPES = [
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.float4_e2m1fn_x2, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.complex64, torch.complex128,
]  # fmt: skip


def _specials(bits: int) -> list[int]:
    """Bit patterns that break float comparisons: ±0, ±inf, NaN payloads, subnormals, extremes."""
    sign = 1 << (bits - 1)
    exp_bits = {8: 4, 16: 5, 32: 8, 64: 11}[bits]
    inf = ((1 << exp_bits) - 1) << (bits - 1 - exp_bits)
    pats = [0, sign, inf, sign | inf, inf | 1, inf | (sign >> 2), sign | inf | 3, 1, sign | 1,
            (1 << (bits - 1 - exp_bits)) - 1, sign - 1, (1 << bits) - 1]  # fmt: skip
    return [p & ((1 << bits) - 1) for p in pats]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def _states_equal(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(_bits_equal(a[k], b[k]) for k in a)


def _tensor(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if bits.size == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(bits.tobytes()), dtype=torch.uint8).view(dtype)


@st.composite
def bit_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A base tensor of adversarial bits and a target differing at a drawn density."""
    dtype = draw(st.sampled_from(DTYPES))
    size = torch.empty(0, dtype=dtype).element_size()
    width = min(size, 8)
    per = size // width
    n = draw(st.integers(0, 200)) * per
    udt = np.dtype(f"<u{width}")
    elems = st.one_of(st.sampled_from(_specials(8 * width)), st.integers(0, 2 ** (8 * width) - 1))
    base = draw(hnp.arrays(udt, n, elements=elems))
    new = draw(hnp.arrays(udt, n, elements=elems))
    density = draw(st.sampled_from([0.0, 0.02, 0.2, 0.7, 1.0]))
    mask = draw(hnp.arrays(np.float64, n, elements=st.floats(0, 1))) < density
    target = np.where(mask, new, base)
    chunk = draw(st.sampled_from([8, 16, 64, 1 << 16]))
    return _tensor(base, dtype), _tensor(target, dtype), chunk


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bit_pairs())
def test_round_trip_is_bitwise_for_every_dtype(
    case: tuple[torch.Tensor, torch.Tensor, int],
) -> None:
    base, target, chunk = case
    patch = encode_patch({"w": base}, {"w": target}, chunk=chunk)
    out = apply_patch({"w": base.clone()}, patch)
    assert _bits_equal(out["w"], target)
    assert state_digest(out) == read_patch_header(patch).target_digest


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_positions_round_trip_in_every_regime(data: st.DataObject) -> None:
    chunk = data.draw(st.sampled_from([8, 16, 64, 256]))
    units = data.draw(st.integers(1, 6 * chunk))
    density = data.draw(st.sampled_from([0.01, 0.1, 0.3, 0.8]))
    keep = data.draw(hnp.arrays(np.float64, units, elements=st.floats(0, 1))) < density
    pos = np.flatnonzero(keep).astype(np.int64)
    enc = encode_positions(pos, units, chunk)
    buf = np.concatenate([enc.modes, *enc.gap_planes, enc.bitmasks.reshape(-1)])
    lens = [p.size for p in enc.gap_planes]
    groups, dense, end = decode_positions(
        buf, enc.modes.size, units, chunk, lens, len(enc.bitmasks)
    )
    assert end == buf.size
    cmode = enc.modes[pos // chunk]
    assert np.array_equal(groups[0], pos[cmode == SPARSE])
    assert np.array_equal(groups[1], pos[cmode == BITMASK])
    assert np.array_equal(dense, np.unique(pos[cmode == DENSE] // chunk))
    counts = np.bincount(pos // chunk, minlength=enc.modes.size)
    assert np.all((enc.modes == 0) == (counts == 0))


@given(hnp.arrays(np.int64, st.integers(0, 50), elements=st.integers(0, 2**56 - 1)))
def test_varint_planes_round_trip(values: np.ndarray) -> None:
    planes = varint_planes(values.copy())
    assert len(planes) <= 8
    assert np.array_equal(varint_values(planes), values)
    if len(planes) > 1:
        with pytest.raises(ValueError, match="varint"):
            varint_values(planes[:-1])


def test_one_tensor_uses_all_three_regimes() -> None:
    chunk = 1 << 16
    base = torch.zeros(4 * chunk + 100, dtype=torch.int16)
    target = base.clone()
    target[torch.arange(0, chunk, 97)] = 1  # sparse: ~1% of chunk 0
    target[chunk + torch.arange(0, chunk, 3)] = 2  # bitmask: a third of chunk 1
    target[2 * chunk : 3 * chunk] = 3  # dense: all of chunk 2; chunk 3 unchanged
    target[-1] = -1  # sparse in the partial last chunk
    enc = encode_positions(torch.nonzero(base != target).reshape(-1).numpy(), base.numel(), chunk)
    assert enc.modes.tolist() == [SPARSE, BITMASK, DENSE, 0, SPARSE]
    patch = encode_patch({"w": base}, {"w": target})
    assert _bits_equal(apply_patch({"w": base.clone()}, patch)["w"], target)
    assert read_patch_header(patch).changed == int((base != target).sum())


def _model(seed: int) -> State:
    g = torch.Generator().manual_seed(seed)
    embed = (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,
        "layers.0.weight": (torch.randn(96, 32, generator=g) * 0.02).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "position_ids": torch.arange(16),
    }


def _step(state: State, seed: int, density: float = 0.05) -> State:
    return adam_like_step(state, seed, density)


def test_twenty_chained_patches_equal_the_direct_target() -> None:
    states = [_model(0)]
    for v in range(1, 21):
        nxt = _step(states[-1], seed=v)
        if v == 7:
            nxt["layers.1.weight"] = torch.randn(8, 8)  # added
        if v == 9:
            nxt["position_ids"] = torch.arange(20)  # reshaped
        if v == 13:
            del nxt["layers.1.weight"]  # removed
        if v == 15:
            nxt["layers.0.norm.weight"] = nxt["layers.0.norm.weight"].float()  # dtype change
        states.append(nxt)
    patches = [encode_patch(a, b) for a, b in itertools.pairwise(states)]
    reader = {k: v.clone() for k, v in states[0].items()}
    reader["lm_head.weight"] = reader["embed.weight"]
    digest = state_digest(reader)
    for p in patches:
        apply_patch(reader, p, base_digest=digest)
        digest = read_patch_header(p).target_digest
    assert _states_equal(reader, states[-1])
    assert reader["lm_head.weight"] is reader["embed.weight"]
    direct = encode_patch(states[0], states[-1])
    fresh = {k: v.clone() for k, v in states[0].items()}
    assert _states_equal(apply_patch(fresh, direct), states[-1])
    squashed = squash(states[0], patches[:8])
    assert read_patch_header(squashed).target_digest == state_digest(states[8])
    assert _states_equal(apply_patch(dict(states[0]), squashed, in_place=False), states[8])


def test_tied_tensor_is_patched_once_and_untying_base_is_safe() -> None:
    base, target = _model(1), _step(_model(1), seed=3, density=0.3)
    header = read_patch_header(encode_patch(base, target))
    ops = {t.name: t.op for t in header.tensors}
    assert ops["lm_head.weight"] == "alias"
    untied = dict(target)
    untied["lm_head.weight"] = target["lm_head.weight"].clone()
    untied["lm_head.weight"].view(torch.int16)[0, 0] += 1
    tied_base = {k: v.clone() for k, v in base.items()}
    tied_base["lm_head.weight"] = tied_base["embed.weight"]
    out = apply_patch(tied_base, encode_patch(base, untied))
    assert _states_equal(out, untied)


def test_tensors_sharing_one_buffer_are_patched_in_place() -> None:
    # a view loaded from one memory-mapped file (or packed into one block) shares a storage
    base = _model(4)
    distinct = {id(t): t for t in base.values()}  # tied names once
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in distinct.values()])
    slices, at = {}, 0
    for key, t in distinct.items():
        nbytes = t.numel() * t.element_size()
        slices[key] = flat[at : at + nbytes].view(t.dtype).reshape(t.shape)
        at += nbytes
    shared = {name: slices[id(t)] for name, t in base.items()}
    target = _step(base, seed=6, density=0.3)
    where = {name: t.data_ptr() for name, t in shared.items()}
    out = apply_patch(shared, encode_patch(base, target))
    assert _states_equal(out, target)
    assert {name: t.data_ptr() for name, t in out.items()} == where  # no tensor was copied


def test_in_place_false_leaves_base_untouched() -> None:
    base, target = _model(2), _step(_model(2), seed=5)
    snapshot = {k: v.clone() for k, v in base.items()}
    out = apply_patch(base, encode_patch(base, target), in_place=False)
    assert _states_equal(out, target)
    assert _states_equal(base, snapshot)


def _patch_pair() -> tuple[State, bytes]:
    base = _model(3)
    return base, encode_patch(base, _step(base, seed=9))


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_any_flipped_byte_is_detected(data: st.DataObject) -> None:
    base, patch = _PAIR
    i = data.draw(st.integers(0, len(patch) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(patch)
    bad[i] ^= flip
    before = {k: v.clone() for k, v in base.items()}
    with pytest.raises(PatchCorrupt):
        apply_patch(base, bytes(bad))
    assert _states_equal(base, before)


_PAIR = _patch_pair()


@pytest.mark.parametrize("cut", [0, 5, 12, 100, -17, -1])
def test_truncated_or_extended_patch_is_refused(cut: int) -> None:
    base, patch = _PAIR
    with pytest.raises(PatchCorrupt, match=r"damaged or truncated|too short"):
        read_patch_header(patch[:cut])
    with pytest.raises(PatchCorrupt):
        apply_patch(dict(base), patch + b"\x00")


def test_wrong_base_is_refused_before_any_write() -> None:
    _, patch = _PAIR
    other = _model(4)
    before = {k: v.clone() for k, v in other.items()}
    with pytest.raises(PatchBaseMismatch, match="patch expects base"):
        apply_patch(other, patch)
    assert _states_equal(other, before)


def test_vouched_wrong_base_fails_the_target_checksum() -> None:
    _, patch = _PAIR
    lie = read_patch_header(patch).base_digest
    with pytest.raises(PatchChecksumMismatch, match="checksum"):
        apply_patch(_model(4), patch, base_digest=lie)


def test_header_reports_counts_and_digests() -> None:
    base = _model(5)
    target = _step(base, seed=11, density=0.1)
    header = read_patch_header(encode_patch(base, target))
    changed = sum(
        int((base[k].view(torch.int16) != target[k].view(torch.int16)).sum())
        for k in ("embed.weight", "layers.0.weight", "layers.0.norm.weight")
    )
    assert header.changed == changed
    assert header.base_digest == state_digest(base)
    assert header.target_digest == state_digest(target)
    assert 0 < header.density < 0.2


def test_bench_codec_small_run_is_exact_and_complete(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_codec.main(["--size-mb", "1", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memcpy_gbps"] > 0
    codecs = {(r["codec"], r["density"]) for r in report["rows"]}
    assert len(codecs) == 12
    sprawl = {r["density"]: r for r in report["rows"] if r["codec"] == "sprawl"}
    assert all(r["exact"] for r in report["rows"])
    assert sprawl[0.01]["bits_per_changed_element"] < 16
    assert sprawl[0.01]["patch_bytes"] < sprawl[0.01]["full_bytes"] / 50
    assert report["scan_device"] == "cpu"
    scatter = {r["density"]: r for r in report["rows"] if r["codec"] == "int32_index_raw"}
    for density, row in sprawl.items():
        ratio = scatter[density]["apply_gbps"] / row["apply_unverified_gbps"]
        assert row["apply_unverified_vs_int32_scatter"] == pytest.approx(ratio)
        ratio = scatter[density]["apply_gbps"] / row["apply_gbps"]
        assert row["apply_vs_int32_scatter"] == pytest.approx(ratio)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here")
def test_bench_codec_on_cuda_without_a_gpu_is_one_line() -> None:
    with pytest.raises(SystemExit, match=r"^orchestrate bench codec: --device cuda: no CUDA GPU"):
        bench_codec.main(["--size-mb", "1", "--device", "cuda"])


def test_encode_and_apply_log_one_line_each() -> None:
    """At debug level (they are per chunk with a streamed publish), whatever level an earlier
    test of this process configured."""
    base, patch = _PAIR
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as logs:
            apply_patch(dict(base), patch, in_place=False)
    finally:
        structlog.configure(**old)
    applied = [e for e in logs if e["event"] == "patch.applied"]
    assert len(applied) == 1
    assert applied[0]["log_level"] == "debug"
    assert applied[0]["target"] == read_patch_header(patch).target_digest


def test_header_checksums_match_the_target() -> None:
    base = _model(6)
    target = _step(base, seed=12)
    header = read_patch_header(encode_patch(base, target))
    assert header.checksums == checksums(target)


def test_a_forked_child_applies_with_workers_of_its_own() -> None:
    """The codec's threads are shared by a process and do not survive a fork: a child that
    applies a patch after its parent did must not wait on the parent's threads forever."""
    base, patch = _PAIR
    expected = apply_patch(dict(base), patch, in_place=False)  # the parent's workers started
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether it made the target, and exit at once
        try:
            got = apply_patch(dict(base), patch, in_place=False)
            same = all(
                torch.equal(got[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in got
            )
            os.write(write, b"1" if same else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answered, _, _ = select.select([read], [], [], 60)  # its answer, or EOF if it died
    got = os.read(read, 1) if answered else b""
    os.close(read)
    if not answered:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert got == b"1", "the forked child did not apply the patch within 60 s"
