"""k by load: schedules in the config, their derivation from round costs and acceptance, the
metrics they need, and `specserve tune` writing one as a revision (costs given: no engine)."""

from __future__ import annotations

import pytest
import yaml

from specserve import k_schedule, tune
from specserve import metrics as m
from specserve.ab.prometheus import ArmTotals
from specserve.ab.report import Options, compare, live_chain, render, suggest_schedule
from specserve.cli import main as cli
from specserve.config.schema import ConfigError, parse_config, revision_of
from specserve.engine import vllm_fixes
from specserve.engine.arm import engine_env, engine_kwargs
from specserve.k_schedule import RoundCosts, derive
from tests.conftest import render_config

EAGLE = """\
model: {name: m, source: s, accelerator: cpu}
arms:
  - {name: base, weight: 1}
  - name: e
    weight: 1
    speculative: {method: eagle3, model: /drafter, num_speculative_tokens: 3%s}
"""


def costs(arm: str = "e") -> RoundCosts:
    """A round at k costs 30 + 2k ms at one request, 40 + 12k at 16 and 60 + 40k at 32:
    drafting is cheap while the batch leaves the cores idle, dear once it fills them."""
    ms = {1: {k: 30 + 2 * k for k in range(4)}, 4: {k: 32 + 4 * k for k in range(4)}}
    ms[16] = {k: 40 + 12 * k for k in range(4)}
    ms[32] = {k: 60 + 40 * k for k in range(4)}
    return RoundCosts(arm, 3, {b: {k: float(v) for k, v in c.items()} for b, c in ms.items()})


CHAIN = [0.6, 0.35, 0.2]  # tokens per round at k = 0..3: 1, 1.6, 1.95, 2.15


@pytest.mark.parametrize(
    "schedule, problem",
    [
        ([[1, 4, 3], [5, 32, 0]], None),
        ([[1, 1, 2]], None),
        ([], "at least one"),
        ([[2, 4, 1]], "expected first = 1"),
        ([[1, 4, 1], [6, 8, 0]], "expected first = 5"),
        ([[1, 4, 1], [3, 8, 0]], "expected first = 5"),
        ([[1, 4, 4]], "between 0 and num_speculative_tokens (3)"),
        ([[1, 4, -1]], "between 0"),
        ([[1, 0, 1]], "first <= last"),
    ],
)
def test_a_schedule_is_checked_as_vllm_would_and_named_in_the_error(schedule, problem):
    assert (k_schedule.problem(schedule, 3) is None) == (problem is None)
    if problem is None:
        return
    assert problem in k_schedule.problem(schedule, 3)
    with pytest.raises(ConfigError, match="num_speculative_tokens_per_batch_size") as caught:
        parse_config(EAGLE % f", num_speculative_tokens_per_batch_size: {schedule}")
    assert problem in str(caught.value)


def test_the_engine_gets_the_schedule_and_per_step_stats_and_an_arm_without_one_is_unchanged():
    with_schedule = parse_config(EAGLE % ", num_speculative_tokens_per_batch_size: [[1, 4, 3]]")
    without = parse_config(EAGLE % "")
    arm = with_schedule.arm("e")
    kwargs = engine_kwargs(arm, with_schedule.model)
    assert kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 3]]
    assert kwargs["per_request_spec_decode_metrics"] == "detailed"
    plain = engine_kwargs(without.arm("e"), without.model)
    assert "num_speculative_tokens_per_batch_size" not in plain["speculative_config"]
    assert plain["per_request_spec_decode_metrics"] == "summary"
    # The Serve config of an arm without a schedule holds no key for it: nothing redeploys.
    assert "num_speculative_tokens_per_batch_size" not in str(without.arm("e").engine_args())
    assert with_schedule.k_by_arm == {"base": [("1+", 0)], "e": [("1+", 3)]}
    two = parse_config(EAGLE % ", num_speculative_tokens_per_batch_size: [[1, 4, 3], [5, 8, 1]]")
    assert two.k_by_arm["e"] == [("1-4", 3), ("5+", 1)]


def test_an_eagle_arm_skips_its_drafter_at_k0_unless_told_not_and_vllm_never_sees_the_key():
    default = parse_config(EAGLE % "")
    arm = default.arm("e")
    assert "skip_drafter_at_k0" not in engine_kwargs(arm, default.model)["speculative_config"]
    assert engine_env(arm)[vllm_fixes.SKIP_DRAFTER_AT_K0_ENV] == "1"
    assert "skip_drafter_at_k0" not in str(arm.engine_args())  # left unset: nothing redeploys
    kept = parse_config(EAGLE % ", skip_drafter_at_k0: false")
    assert vllm_fixes.SKIP_DRAFTER_AT_K0_ENV not in engine_env(kept.arm("e"))
    assert vllm_fixes.SKIP_DRAFTER_AT_K0_ENV not in engine_env(default.arm("base"))


def test_an_eagle_arm_drafts_by_its_own_vocabularys_argmax_unless_told_not():
    default = parse_config(EAGLE % "")
    spec = engine_kwargs(default.arm("e"), default.model)["speculative_config"]
    assert spec["use_local_argmax_reduction"] is True
    assert "use_local_argmax_reduction" not in str(default.arm("e").engine_args())  # no redeploy
    off = parse_config(EAGLE % ", use_local_argmax_reduction: false")
    spec = engine_kwargs(off.arm("e"), off.model)["speculative_config"]
    assert spec["use_local_argmax_reduction"] is False


def test_an_eagle_arm_looks_up_its_prompt_first_only_when_told_and_vllm_never_sees_the_key():
    default = parse_config(EAGLE % "")
    assert vllm_fixes.PROMPT_LOOKUP_FIRST_ENV not in engine_env(default.arm("e"))
    lookup = parse_config(EAGLE % ", prompt_lookup_first: 3")
    arm = lookup.arm("e")
    assert engine_env(arm)[vllm_fixes.PROMPT_LOOKUP_FIRST_ENV] == "3"
    assert "prompt_lookup_first" not in engine_kwargs(arm, lookup.model)["speculative_config"]
    assert "prompt_lookup_first" in str(arm.engine_args())  # a change redeploys the arm
    with pytest.raises(ConfigError, match="prompt_lookup_first"):
        parse_config(EAGLE % ", prompt_lookup_first: 0")
    on_gpus = (EAGLE % ", prompt_lookup_first: 3").replace("accelerator: cpu", "accelerator: gpu")
    with pytest.raises(ConfigError, match="prompt_lookup_first needs model.accelerator: cpu"):
        parse_config(on_gpus)


def test_each_batch_size_gets_the_k_with_the_most_tokens_per_second():
    picked = {c.batch_size: c for c in k_schedule.choices(costs(), CHAIN)}
    assert picked[1].k == 3  # 2.15 / 36 ms beats 1 / 30 ms
    assert picked[4].k == 3  # 2.15 / 44 beats 1.95 / 40 and 1 / 32
    assert picked[16].k == 1  # 1.6 / 52 beats 1 / 40 and 1.95 / 64
    assert picked[32].k == 0  # 1 / 60 beats 1.6 / 100
    assert picked[16].tokens_per_s[1] == pytest.approx(1000 * 1.6 / 52)
    assert picked[32].gain() == 1.0
    # Split at geometric means: 1-2 and 4 -> k=3 (merged), 16 from sqrt(4*16)+1 = 9, 32 from 23.
    assert derive(costs(), CHAIN) == [(1, 8, 3), (9, 22, 1), (23, 32, 0)]
    assert k_schedule.describe(derive(costs(), CHAIN)) == "1-8: k=3, 9-22: k=1, 23+: k=0"
    assert k_schedule.k_at(derive(costs(), CHAIN), 100) == 0


def physical_ms(b: int, k: int) -> float:
    """A round as `k_schedule.round_terms` sees it: 22 ms, 0.9 per verified token and 0.002 per
    its square, 0.4 per drafted token, 0.5 per drafter pass, 1 for the speculative path."""
    verified = b * (k + 1)
    return 22 + 0.9 * verified + 0.002 * verified**2 + 0.4 * b * k + 0.5 * k + (k > 0)


def test_the_schedule_comes_from_the_fitted_costs_so_a_burst_of_slow_steps_does_not_flip_it():
    sizes = (1, 2, 4, 8, 12, 16)
    clean = RoundCosts("e", 3, {b: {k: physical_ms(b, k) for k in range(4)} for b in sizes})
    assert k_schedule.fit(clean).median_error < 1e-9
    assert derive(clean, CHAIN) == [(1, 1, 3), (2, 4, 2), (5, 13, 1), (14, 16, 0)]
    # As measured on a shared core: every cell 1-2 % off, and one (16 requests, k = 0) 25 % slow.
    wobble = [1.02, 0.98, 1.01, 0.99, 0.98, 1.02]
    noisy = {
        b: {k: physical_ms(b, k) * wobble[(i + k) % 6] for k in range(4)}
        for i, b in enumerate(sizes)
    }
    noisy[16][0] *= 1.25
    measured = RoundCosts("e", 3, noisy)
    fitted = k_schedule.fit(measured)
    assert fitted.median_error < 0.02 and fitted.ms(16, 0) == pytest.approx(
        physical_ms(16, 0), 0.02
    )
    # Taking each cell as measured would draft at 16, where drafting loses ...
    assert {c.batch_size: c.k for c in k_schedule.choices(measured, CHAIN)}[16] == 1

    def loss(schedule, b):
        """Per-user tokens/s at b under the true costs, against the best k there."""
        rate = {k: k_schedule.expected_tokens(CHAIN, k) / physical_ms(b, k) for k in range(4)}
        return 1 - rate[k_schedule.k_at(schedule, b)] / max(rate.values())

    # ... and the fitted schedule says k = 0 there and loses anywhere no more than the cells'
    # own error (2 %) and the margin (1 %).
    schedule = derive(measured, CHAIN)
    assert k_schedule.k_at(schedule, 16) == 0 and k_schedule.k_at(schedule, 1) == 3
    assert max(loss(schedule, b) for b in range(1, 17)) <= 0.02 + k_schedule.PICK_MARGIN
    assert loss(k_schedule.derive(RoundCosts("e", 3, {16: noisy[16]}), CHAIN), 16) > 0.02
    # Too few cells for a fit (16 for 6 coefficients): each measured size's best k, spread.
    assert k_schedule.fit(costs()) is None


def test_a_drafter_that_is_never_right_gets_k_zero_everywhere():
    assert derive(costs(), [0.0, 0.0, 0.0]) == [(1, 32, 0)]
    assert derive(costs(), []) == [(1, 32, 0)]  # no acceptance known: nothing to gain


def test_acceptance_once_drafted_counts_only_drafts_that_reached_the_position():
    # Per-step draft lengths (an arm with a schedule): 3, 3, 1, 0 drafted.
    stats = {"per_step_drafted": [3, 3, 1], "num_spec_steps": 3, "num_draft_tokens": 7}
    assert m.drafted_per_position(stats) == [3, 2, 2]
    # Summary stats (a fixed k): every step drafted the mean length.
    assert m.drafted_per_position({"num_spec_steps": 4, "num_draft_tokens": 12}) == [4, 4, 4]
    assert m.drafted_per_position({}) == []
    totals = ArmTotals(drafts=10, accepted_per_position=[6, 2], drafted_per_position=[10, 4, 4])
    assert live_chain(totals) == [0.6, 0.5, 0.0]
    # Data from before the drafted counter: over every draft, as vLLM defines it.
    assert live_chain(ArmTotals(drafts=10, accepted_per_position=[6, 2])) == [0.6, 0.2]


def test_costs_survive_a_round_trip_through_their_file(tmp_path):
    original = costs()
    original.bench_chain = [0.5, 0.25]
    loaded = RoundCosts.load(original.save(tmp_path / "e.json"))
    assert loaded == original


def test_ab_report_recommends_the_schedule_tune_writes(tmp_path):
    costs().save(tmp_path / "e.json")
    totals = ArmTotals(
        weight=1,
        drafts=1000,
        accepted_per_position=[600, 350, 200],
        drafted_per_position=[1000] * 3,
    )
    recommended = suggest_schedule("e", totals, tmp_path)
    assert recommended is not None
    config = parse_config(EAGLE % "")
    (tuning,) = tune.plan(config, {"e": costs()}, {"e": totals}, min_drafts=100)
    assert tuning.acceptance_from == tune.LIVE
    assert recommended["schedule"] == [list(r) for r in tuning.schedule]
    rows = compare(
        {"base": ArmTotals(weight=1), "e": totals},
        {},
        {},
        Options(baseline="base", round_costs=tmp_path),
    )
    report = rows | {"since": 0, "now": 60, "model": "m", "revision": "r"}
    report |= {"alpha": 0.05, "baseline": "base"}
    assert "e: 1-8: k=3, 9-22: k=1, 23+: k=0" in render(report)
    assert suggest_schedule("e", totals, None) is None
    assert suggest_schedule("e", ArmTotals(), tmp_path) is None


def test_tune_falls_back_on_the_bench_acceptance_without_enough_live_drafts():
    config = parse_config(EAGLE % "")
    measured = costs()
    measured.bench_chain = [0.0, 0.0, 0.0]
    few = ArmTotals(drafts=50, accepted_per_position=[40, 30, 20], drafted_per_position=[50] * 3)
    (tuning,) = tune.plan(config, {"e": measured}, {"e": few}, min_drafts=100)
    assert tuning.acceptance_from == tune.BENCH and tuning.schedule == [(1, 32, 0)]


def ngram_costs(arm: str = "ngram") -> RoundCosts:
    c = costs(arm)
    c.bench_chain = CHAIN
    return c


def test_tune_writes_a_revision_history_shows_and_rollback_undoes(tmp_path, capsys):
    live = tmp_path / "config.yaml"
    first = render_config()
    live.write_text(first)
    costs_dir = tmp_path / "costs"
    ngram_costs().save(costs_dir / "ngram.json")
    args = ["tune", "--local", str(live), "--costs", str(costs_dir)]

    assert cli([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ngram: acceptance once drafted by position 0.60/0.35/0.20 (from bench prompts)" in out
    assert "schedule: 1-8: k=3, 9-22: k=1, 23+: k=0   (was: k=3; from the measured costs)" in out
    assert "dry run" in out and live.read_text() == first

    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "applied revision" in out and "ngram redeploy" in out
    tuned = parse_config(live.read_bytes())
    assert tuned.arm("ngram").speculative.num_speculative_tokens_per_batch_size == [
        (1, 8, 3),
        (9, 22, 1),
        (23, 32, 0),
    ]
    assert tuned.arm("no-spec") == parse_config(first.encode()).arm("no-spec")
    assert "- [1, 8, 3]" in live.read_text()  # one line per range
    assert cli(args) == 0  # the same measurements again: nothing to change
    assert "already in force" in capsys.readouterr().out

    assert cli(["config", "history", "--local", str(live)]) == 0
    history = capsys.readouterr().out
    assert revision_of(live.read_bytes()) in history and revision_of(first.encode()) in history
    assert cli(["config", "rollback", "--local", str(live)]) == 0
    assert live.read_text() == first


def test_tune_refuses_unknown_arms_and_a_cluster_without_measured_costs(tmp_path, capsys):
    live = tmp_path / "config.yaml"
    live.write_text(render_config())
    assert cli(["tune", "--local", str(live), "--arms", "no-spec", "--dry-run"]) == 2
    assert "not drafting arms of the live config: no-spec" in capsys.readouterr().err
    assert cli(["tune", "--release", "r", "-n", "ns"]) == 2
    assert "--costs DIR" in capsys.readouterr().err


def test_the_tuned_text_keeps_every_other_setting():
    text, config = tune.tuned_text(render_config(), {"ngram": [(1, 4, 2), (5, 16, 0)]})
    before, after = yaml.safe_load(render_config()), yaml.safe_load(text)
    assert after["arms"][1]["speculative"].pop("num_speculative_tokens_per_batch_size") == [
        [1, 4, 2],
        [5, 16, 0],
    ]
    assert after == before
    assert config.k_by_arm["ngram"] == [("1-4", 2), ("5+", 0)]


def test_an_arm_whose_best_k_is_its_fixed_k_everywhere_keeps_its_config(tmp_path, capsys):
    live = tmp_path / "config.yaml"
    live.write_text(render_config())
    cheap = RoundCosts("ngram", 3, {b: {k: 30.0 + k for k in range(4)} for b in (1, 8, 32)})
    cheap.bench_chain = CHAIN
    cheap.save(tmp_path / "costs" / "ngram.json")
    before = live.read_text()
    assert cli(["tune", "--local", str(live), "--costs", str(tmp_path / "costs")]) == 0
    out = capsys.readouterr().out
    assert (
        "schedule: 1+: k=3   (was: k=3; from the measured costs)" in out
        and "already in force" in out
    )
    assert live.read_text() == before  # no revision: its engines keep running


def test_the_gate_scores_at_the_highest_k_the_incumbent_serves_at(tmp_path):
    from specserve.drafter.adapt import AdaptConfig
    from specserve.drafter_commands import serving_k

    assert k_schedule.highest_k(3, None) == 3
    assert k_schedule.highest_k(5, [(1, 4, 4), (5, 16, 2), (17, 256, 0)]) == 4
    assert k_schedule.highest_k(3, [(1, 8, 5)]) == 3  # vLLM clamps to num_speculative_tokens
    assert k_schedule.highest_k(3, [(1, 256, 0)]) == 1  # drafting off everywhere: still scored

    text = render_config().replace(
        "speculative: {method: ngram, num_speculative_tokens: 3,",
        "speculative: {method: ngram, num_speculative_tokens: 5, "
        "num_speculative_tokens_per_batch_size: [[1, 4, 4], [5, 256, 2]],",
    )
    live = parse_config(text.encode(), source="test")
    ngram = next(a for a in live.arms if a.name == "ngram")
    assert ngram.speculative.num_speculative_tokens == 5  # the edit took
    base = AdaptConfig(
        base="b", captured=tmp_path, work_dir=tmp_path, out_dir=tmp_path, target_dir="t"
    )
    scored = serving_k(base, ngram)
    assert (scored.k, scored.k_source) == (4, "arm ngram's schedule")
    no_spec = next(a for a in live.arms if a.name == "no-spec")
    assert serving_k(base, no_spec) == base


def test_the_gate_scores_with_the_prompt_lookup_the_incumbent_serves_with(tmp_path):
    from specserve.drafter.adapt import AdaptConfig
    from specserve.drafter.evaluate import _check_lookup_in_force, scoring_env
    from specserve.drafter_commands import serving_lookup

    base = AdaptConfig(
        base="b", captured=tmp_path, work_dir=tmp_path, out_dir=tmp_path, target_dir="t"
    )
    assert base.prompt_lookup_first == 0
    with_lookup = parse_config(EAGLE % ", prompt_lookup_first: 3")
    assert serving_lookup(base, with_lookup.arm("e")).prompt_lookup_first == 3
    assert serving_lookup(base, parse_config(EAGLE % "").arm("e")) == base
    assert serving_lookup(base, with_lookup.arm("base")) == base
    # The scoring engine's plugin reads it from the environment; none is an empty value, so a
    # process that scored with a lookup before does not pass it on.
    assert scoring_env(1, 3)[vllm_fixes.PROMPT_LOOKUP_FIRST_ENV] == "3"
    assert scoring_env(1, 0)[vllm_fixes.PROMPT_LOOKUP_FIRST_ENV] == ""
    # This process never loaded the plugin with a lookup: asking for one is refused.
    _check_lookup_in_force(0)
    with pytest.raises(RuntimeError, match="once per process"):
        _check_lookup_in_force(3)


def test_round_costs_keep_the_cores_they_were_measured_on(tmp_path):
    costs = RoundCosts("e", 1, {4: {0: 30.0, 1: 40.0}}, "AMD EPYC, 2 CPUs", cores=[1])
    again = RoundCosts.load(costs.save(tmp_path / "e.json"))
    assert again.cores == [1] and again.where() == "AMD EPYC, 2 CPUs, the engine on core 1"
    # A file written before the cores were recorded says so instead of guessing.
    older = costs.to_json()
    del older["cores"]
    assert RoundCosts.from_json(older).where() == (
        "AMD EPYC, 2 CPUs, cores unrecorded (maybe every core: measure again)"
    )
