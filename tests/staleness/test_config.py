"""Staleness config: TOML shapes parse, bad values fail naming the key, no torch on import."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
from pydantic import ValidationError

from staleness.config import (
    CISPO,
    GSPO,
    M2PO,
    DecoupledPPO,
    DropRule,
    MaskedIS,
    NoCorrection,
    StalenessConfig,
    TokenMask,
    TruncatedIS,
)


def _load(text: str) -> StalenessConfig:
    return StalenessConfig.model_validate(tomllib.loads(text)["staleness"])


def test_defaults_are_no_correction_and_no_drop() -> None:
    cfg = StalenessConfig()
    assert cfg.correction == NoCorrection()
    assert cfg.drop is None


def test_toml_layout_from_the_docs_parses() -> None:
    cfg = _load(
        """
        [staleness]
        drop = { statistic = "token_weighted", max_lag = 4 }
        [staleness.correction]
        type = "tis"
        cap = 3.0
        """
    )
    assert cfg.drop == DropRule(statistic="token_weighted", max_lag=4)
    assert cfg.correction == TruncatedIS(cap=3.0)


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('type = "none"', NoCorrection()),
        ('type = "tis"', TruncatedIS(cap=2.0)),
        ('type = "tis"\nlevel = "sequence"\ncap = 5.0', TruncatedIS(cap=5.0, level="sequence")),
        ('type = "mis"\nupper = 4.0', MaskedIS(upper=4.0)),
        (
            'type = "mis"\naggregate = "geometric"\nreweight = false\nupper = 1.01',
            MaskedIS(aggregate="geometric", reweight=False, upper=1.01),
        ),
        ('type = "decoupled_ppo"', DecoupledPPO(cap=None)),
        ('type = "decoupled_ppo"\ncap = 5.0', DecoupledPPO(cap=5.0)),
        ('type = "token_mask"\nc = 1.5', TokenMask(c=1.5)),
        ('type = "m2po"', M2PO(threshold=0.04)),
        ('type = "m2po"\nthreshold = 0.1', M2PO(threshold=0.1)),
        ('type = "cispo"', CISPO(clip_eps=1.0, clip_eps_high=4.0, anchor="behaviour")),
        (
            'type = "cispo"\nanchor = "proximal"\nclip_eps = 0.2\nclip_eps_high = 0.28',
            CISPO(anchor="proximal", clip_eps=0.2, clip_eps_high=0.28),
        ),
    ],
)
def test_each_policy_parses(table: str, expected: object) -> None:
    assert _load(f"[staleness.correction]\n{table}\n").correction == expected


def test_loss_options_parse_from_the_staleness_table() -> None:
    cfg = StalenessConfig()
    assert (cfg.loss_agg, cfg.normalizer, cfg.dr_grpo_tokens) == ("token_mean", "kept", None)
    assert cfg.scales_rewards
    cfg = _load(
        """
        [staleness]
        loss_agg = "dr_grpo"
        dr_grpo_tokens = 512
        normalizer = "original"
        """
    )
    assert (cfg.loss_agg, cfg.dr_grpo_tokens, cfg.normalizer) == ("dr_grpo", 512, "original")
    assert not cfg.scales_rewards  # Dr. GRPO drops the std unless told otherwise
    assert _load('[staleness]\nloss_agg = "dr_grpo"\ndr_grpo_tokens = 8\nscale_rewards = true\n')
    assert _load('[staleness]\nloss_agg = "seq_mean"\n').loss_agg == "seq_mean"
    assert not _load("[staleness]\nscale_rewards = false\n").scales_rewards


def test_loss_option_errors_name_the_key() -> None:
    assert _error_locs({"normalizer": "batch"}) == [("normalizer",)]
    assert _error_locs({"loss_agg": "sum"}) == [("loss_agg",)]
    assert _error_locs({"correction": {"type": "tis", "level": "seq"}}) == [
        ("correction", "tis", "level")
    ]
    assert _error_locs({"loss_agg": "dr_grpo", "dr_grpo_tokens": 0}) == [("dr_grpo_tokens",)]
    with pytest.raises(ValidationError, match="dr_grpo_tokens: required"):
        StalenessConfig(loss_agg="dr_grpo")
    with pytest.raises(ValidationError, match="dr_grpo_tokens: only used"):
        StalenessConfig(dr_grpo_tokens=64)


def test_gspo_parses_with_seq_mean_and_names_loss_agg_without() -> None:
    cfg = _load('[staleness]\nloss_agg = "seq_mean"\n[staleness.correction]\ntype = "gspo"\n')
    assert cfg.correction == GSPO(clip_eps=3e-4, clip_eps_high=4e-4)
    with pytest.raises(ValidationError, match=r"loss_agg: correction\.type = 'gspo'.*'token_mean'"):
        StalenessConfig(correction=GSPO())


@pytest.mark.parametrize(
    ("correction", "loc"),
    [
        ({"type": "m2po", "threshold": 0.0}, ("correction", "m2po", "threshold")),
        ({"type": "cispo", "clip_eps": 1.5}, ("correction", "cispo", "clip_eps")),
        ({"type": "cispo", "clip_eps_high": 0.0}, ("correction", "cispo", "clip_eps_high")),
        ({"type": "cispo", "anchor": "old"}, ("correction", "cispo", "anchor")),
        ({"type": "gspo", "clip_eps": 1.0}, ("correction", "gspo", "clip_eps")),
    ],
)
def test_new_policy_bounds_name_the_key(
    correction: dict[str, object], loc: tuple[str, ...]
) -> None:
    data = {"correction": correction, "loss_agg": "seq_mean"}
    assert _error_locs(data) == [loc]


def test_effective_drop_is_the_lag_budget_without_a_rule() -> None:
    assert StalenessConfig().effective_drop(3) == DropRule(statistic="max", max_lag=3)
    rule = DropRule(statistic="token_weighted", max_lag=5)
    assert StalenessConfig(drop=rule).effective_drop(1) == rule


def test_mis_lower_defaults_to_reciprocal_of_upper() -> None:
    assert MaskedIS(upper=4.0).lower_bound == pytest.approx(0.25)
    assert MaskedIS(upper=4.0, lower=0.1).lower_bound == pytest.approx(0.1)


def _error_locs(data: dict[str, object]) -> list[tuple[str | int, ...]]:
    with pytest.raises(ValidationError) as info:
        StalenessConfig.model_validate(data)
    return [e["loc"] for e in info.value.errors()]


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_tis_cap_must_be_positive_and_error_names_cap(cap: float) -> None:
    assert _error_locs({"correction": {"type": "tis", "cap": cap}}) == [
        ("correction", "tis", "cap")
    ]


def test_decoupled_cap_at_most_one_rejected_naming_cap() -> None:
    locs = _error_locs({"correction": {"type": "decoupled_ppo", "cap": 1.0}})
    assert locs == [("correction", "decoupled_ppo", "cap")]


def test_token_mask_c_must_exceed_one() -> None:
    assert _error_locs({"correction": {"type": "token_mask", "c": 0.5}}) == [
        ("correction", "token_mask", "c")
    ]


def test_unknown_policy_type_is_rejected_naming_type() -> None:
    with pytest.raises(ValidationError) as info:
        StalenessConfig.model_validate({"correction": {"type": "vtrace"}})
    (err,) = info.value.errors()
    assert err["loc"] == ("correction",)
    assert err["type"] == "union_tag_invalid"
    assert "'type'" in str(info.value)
    assert "vtrace" in str(info.value)


def test_missing_type_is_rejected() -> None:
    with pytest.raises(ValidationError, match="discriminator 'type'"):
        StalenessConfig.model_validate({"correction": {"cap": 2.0}})


def test_unknown_field_is_rejected_naming_it() -> None:
    locs = _error_locs({"correction": {"type": "tis", "cpa": 2.0}})
    assert locs == [("correction", "tis", "cpa")]
    assert _error_locs({"drop": {"max_lag": 2, "stat": "max"}}) == [("drop", "stat")]


def test_drop_rule_bounds() -> None:
    assert _error_locs({"drop": {"max_lag": -1}}) == [("drop", "max_lag")]
    assert _error_locs({"drop": {"statistic": "median", "max_lag": 1}}) == [("drop", "statistic")]


def test_geometric_mis_cannot_reweight() -> None:
    with pytest.raises(ValidationError, match="reweight"):
        MaskedIS(aggregate="geometric")


def test_mis_lower_must_be_below_one() -> None:
    assert _error_locs({"correction": {"type": "mis", "lower": 1.5}}) == [
        ("correction", "mis", "lower")
    ]


def test_every_field_is_documented() -> None:
    models = (DropRule, NoCorrection, TruncatedIS, MaskedIS, DecoupledPPO, TokenMask)
    for model in (*models, M2PO, CISPO, GSPO):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
    for name, field in StalenessConfig.model_fields.items():
        assert field.description, f"StalenessConfig.{name} has no docstring"


def test_importing_config_and_lag_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import staleness.config, staleness.lag, staleness.types\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
