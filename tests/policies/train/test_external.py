"""The external trainer's helpers give what the reference trainer computes from the same batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from policies.board import Board
from policies.errors import PolicyError
from policies.train.config import TrainerConfig
from policies.train.external import correction, scored_logprobs, wire_tensors
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from policies.wire.batches import BatchFile, BatchSample, SegmentSampling
from staleness.config import StalenessConfig, TruncatedIS
from staleness.metrics import correction_metrics

GROUP = 2


def _batch(version: int, staleness: StalenessConfig | None) -> BatchFile:
    """Two groups; each sample has a prompt and two model calls, one made at ``version - 1``."""
    rng = random.Random(0)
    samples = []
    for i in range(2 * GROUP):
        n_prompt, n_a, n_tool, n_b = 3 + i, 2 + i, 2, 3
        n = n_prompt + n_a + n_tool + n_b
        mask = [False] * n_prompt + [True] * n_a + [False] * n_tool + [True] * n_b
        b_start = n_prompt + n_a + n_tool
        samples.append(
            BatchSample(
                episode_id=f"e{i}",
                group_id=f"g{i // GROUP}",
                token_ids=[rng.randrange(10, 2000) for _ in range(n)],
                mask=mask,
                behaviour_logprobs=[-rng.uniform(6.0, 9.0) if m else 0.0 for m in mask],
                reward=float(i % 2) + 0.25 * i,
                policy_versions=[
                    (n_prompt, n_prompt + n_a, version - 1, version - 1),
                    (b_start, n, version, version),
                ],
            )
        )
    wire = None if staleness is None else staleness.model_dump(mode="json")
    return BatchFile(version=version, group_size=GROUP, samples=samples, staleness=wire)


def test_per_token_lag_follows_each_model_call() -> None:
    batch = _batch(3, StalenessConfig())
    t = wire_tensors(batch)
    row = t.lag[0]  # 3 prompt, 2 tokens at lag 1, 2 tool tokens, 3 tokens at lag 0
    assert row[:2].tolist() == [-1, -1]  # position t scores token t + 1
    assert row[2:4].tolist() == [1, 1]
    assert row[4:6].tolist() == [-1, -1]
    assert row[6:9].tolist() == [0, 0, 0]
    assert (t.lag >= 0).equal(t.mask)
    # GRPO within each group of two, over the whole batch; rows() keeps them
    assert t.rows(slice(2, 4)).advantages.tolist() == pytest.approx(t.advantages[2:4].tolist())
    assert t.advantages.tolist() == pytest.approx([-1.0, 1.0, -1.0, 1.0], abs=1e-5)


def test_a_batch_without_a_usable_staleness_section_is_refused() -> None:
    with pytest.raises(PolicyError, match=r"batch 3 carries no \[staleness\] section"):
        wire_tensors(_batch(3, None))
    odd = _batch(3, StalenessConfig()).model_copy(update={"staleness": {"correction": "x"}})
    with pytest.raises(PolicyError, match=r"batch 3: its \[staleness\] section is not"):
        wire_tensors(odd)


def test_the_correction_is_the_reference_trainers(tmp_path: Path, tiny_model_dir: Path) -> None:
    """An external trainer that scores the batch with its own weights and calls the helpers gets
    the correction the in-process trainer applies to the same batch: same IS statistics."""
    staleness = StalenessConfig(correction=TruncatedIS(cap=1.02))
    batch = _batch(1, staleness)
    trainer = Trainer(
        tiny_model_dir,
        Board(str(tmp_path / "board"), "run"),
        TrainerConfig(lr=1e-3),
        staleness=staleness,
        temperature=1.0,
        group_size=GROUP,
    )
    train_samples = [TrainSample.from_wire(s) for s in batch.samples]
    logp_prox, _ = trainer.logprobs(train_samples)  # the external trainer's own π_prox
    t = wire_tensors(batch)
    corrected = correction(batch, t, logp_prox)
    ours = correction_metrics(
        staleness.correction, corrected, logp_prox=logp_prox, logp_behav=t.behaviour, mask=t.mask
    )
    theirs = trainer.step(train_samples)
    assert 0 < ours["is/frac_truncated"] < 1  # the cap bites on some tokens, not all
    for name, value in ours.items():
        assert theirs[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert corrected.weights.max() <= 1.02 + 1e-6
    assert not corrected.weights[~t.mask].any()
    assert torch.equal(corrected.mask, t.mask)  # TIS truncates, it does not mask


def test_scored_logprobs_apply_each_calls_transforms_as_the_trainer(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """With top-k / top-p recorded per model call, the helper's log probs of the batch's tokens
    are the reference trainer's (which scores as the engine sampled), not a plain softmax's."""
    base = _batch(1, StalenessConfig())
    samples = []
    for s in base.samples:
        (a0, a1, _, _), (b0, b1, _, _) = s.policy_versions
        calls = [SegmentSampling(a0, a1, 0.7, 5, 1.0), SegmentSampling(b0, b1, 1.0, 0, 0.8)]
        samples.append(s.model_copy(update={"sampling": calls}))
    batch = base.model_copy(update={"samples": samples})
    trainer = Trainer(
        tiny_model_dir,
        Board(str(tmp_path / "board"), "run"),
        TrainerConfig(),
        staleness=StalenessConfig(),
        temperature=1.0,
        group_size=GROUP,
    )
    theirs, _ = trainer.logprobs([TrainSample.from_wire(s) for s in batch.samples])
    t = wire_tensors(batch)
    with torch.no_grad():
        logits = trainer.model(input_ids=t.ids, attention_mask=t.attention).logits[:, :-1]
    ours = scored_logprobs(logits, t)
    assert torch.equal(ours[t.mask].isinf(), theirs[t.mask].isinf())
    finite = t.mask & ours.isfinite()
    assert finite.any()
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-5)
    plain = torch.log_softmax(logits.float(), -1).gather(-1, t.ids[:, 1:, None]).squeeze(-1)
    assert not torch.allclose(ours[finite], plain[finite], atol=1e-3)  # the transforms matter
