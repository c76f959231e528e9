"""The huge-page arena a receiver keeps its view in: exact copies, ties kept, patched in place."""

from __future__ import annotations

import gc

import pytest
import torch

from policies.arena import HUGE_PAGE, LINE, allocate, pack
from policies.codec import apply_patch, encode_patch
from tests.boards import adam_like_step


def _view() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(33, 16, generator=gen).to(torch.bfloat16)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied
        "layer.weight": torch.randn(16, 24, generator=gen).to(torch.float8_e4m3fn),
        "layer.weight_scale": torch.tensor(0.5),
        "mask": torch.rand(7, generator=gen) > 0.5,
        "positions": torch.arange(5, dtype=torch.int64),
        "transposed": torch.randn(8, 4, generator=gen).t(),  # not contiguous
        "empty": torch.empty(0, 3),
        "empty_too": torch.empty(0),
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_pack_copies_every_tensor_bit_for_bit_into_one_aligned_block() -> None:
    view = _view()
    packed = pack(view)
    assert packed.keys() == view.keys()
    storages = set()
    for name, t in view.items():
        got = packed[name]
        assert got.dtype == t.dtype, name
        assert got.shape == t.shape, name
        assert got.is_contiguous(), name
        assert _bits(got) == _bits(t), name
        if got.numel():
            assert got.data_ptr() % LINE == 0, name
            storages.add(got.untyped_storage().data_ptr())
    assert len(storages) == 1  # one block for the whole view
    assert packed["embed.weight"].data_ptr() % HUGE_PAGE == 0  # the first starts the block


def test_pack_keeps_tied_names_tied_and_nothing_else() -> None:
    packed = pack(_view())
    assert packed["lm_head.weight"] is packed["embed.weight"]
    packed["embed.weight"][0, 0] = 7.0
    assert packed["lm_head.weight"][0, 0] == 7.0
    assert packed["empty"].shape == (0, 3)
    assert packed["empty_too"].shape == (0,)
    before = _bits(packed["positions"])
    packed["layer.weight_scale"].fill_(2.0)  # its neighbour in the block is unaffected
    assert _bits(packed["positions"]) == before


def test_the_block_lives_as_long_as_any_tensor_into_it() -> None:
    packed = pack(_view())
    keep = packed["positions"]
    del packed
    gc.collect()
    assert keep.tolist() == [0, 1, 2, 3, 4]


def test_a_patch_applies_in_place_in_a_packed_view_and_ties_survive() -> None:
    base = pack(_view())
    target = adam_like_step(base, seed=1, density=0.2)
    target["layer.weight"] = target["layer.weight"].clone()
    target["layer.weight"].view(torch.uint8)[0, :5] ^= 1
    patch = encode_patch(base, target)
    where = {name: t.data_ptr() for name, t in base.items()}
    out = apply_patch(base, patch)
    for name in target:
        assert _bits(out[name]) == _bits(target[name]), name
        # written into the arena itself: every tensor shares its storage, yet none was copied
        assert out[name].data_ptr() == where[name], name
    assert out["lm_head.weight"] is out["embed.weight"]


def test_pack_refuses_tensors_off_the_cpu() -> None:
    with pytest.raises(ValueError, match=r"meta\.weight: only CPU tensors"):
        pack({"meta.weight": torch.empty(3, device="meta")})


def test_allocate_gives_zeroed_memory_of_the_asked_size() -> None:
    block = allocate(3 * HUGE_PAGE + 5)
    assert block.numel() == 3 * HUGE_PAGE + 5
    assert block.dtype == torch.uint8
    assert int(block.sum()) == 0
