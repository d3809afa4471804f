"""The acceptance guardrail drains an arm whose mean acceptance length falls below the floor,
and gives it traffic again after the drain."""

from specserve.config.schema import GuardrailConfig
from specserve.router.guardrail import AcceptanceGuard
from specserve.router.selection import choose_arm


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def guard(clock, **config) -> AcceptanceGuard:
    defaults = {"min_acceptance_length": 1.5, "window_s": 60, "min_drafts": 100, "drain_s": 300}
    return AcceptanceGuard(GuardrailConfig(**(defaults | config)), clock)


def test_off_by_default_never_drains():
    g = AcceptanceGuard(GuardrailConfig())
    assert not any(g.observe("eagle3", 1000, 0) for _ in range(10))
    assert g.drained() == frozenset()


def test_drains_only_with_enough_steps_below_the_floor():
    clock = Clock()
    g = guard(clock)
    assert not g.observe("eagle3", 60, 6)  # mean 1.1, but 60 < 100 steps: not judged yet
    assert g.observe("eagle3", 60, 6)  # 120 steps, mean 1.1 < 1.5
    assert g.drained() == {"eagle3"}
    assert not g.observe("eagle3", 100, 0)  # a drained arm is not judged again


def test_a_healthy_arm_stays_and_old_requests_leave_the_window():
    clock = Clock()
    g = guard(clock)
    assert not g.observe("eagle3", 100, 80)  # mean 1.8
    clock.now += 61  # the healthy requests age out of the window
    assert not g.observe("eagle3", 60, 0)  # only 60 steps in the window now
    assert g.observe("eagle3", 60, 0)
    assert g.drained() == {"eagle3"}


def test_a_drained_arm_takes_traffic_again_after_the_drain_and_is_judged_afresh():
    clock = Clock()
    g = guard(clock, drain_s=30)
    assert g.observe("ngram", 200, 10)
    clock.now += 29
    assert g.drained() == {"ngram"}
    clock.now += 2
    assert g.drained() == frozenset()
    assert not g.observe("ngram", 99, 0)  # fresh window: 99 steps are not enough
    assert g.observe("ngram", 1, 0)


def test_a_new_guardrail_config_starts_over():
    clock = Clock()
    g = guard(clock)
    assert g.observe("ngram", 200, 10)
    g.reconfigure(GuardrailConfig(min_acceptance_length=1.01, min_drafts=100))
    assert g.drained() == frozenset()
    assert not g.observe("ngram", 200, 10)  # mean 1.05 >= 1.01


def test_drained_arms_get_no_weighted_or_sticky_traffic_but_the_override_reaches_them():
    weights = {"no-spec": 1.0, "eagle3": 1.0}
    picks = {
        choose_arm(weights, drained={"eagle3"}, sticky_key=f"user-{i}").arm for i in range(200)
    }
    assert picks == {"no-spec"}
    assert choose_arm(weights, drained={"eagle3"}, override="eagle3").arm == "eagle3"
    # A drain never leaves the split empty: with every arm drained, the weights decide.
    picks = {choose_arm(weights, drained=set(weights)).arm for _ in range(200)}
    assert picks == {"no-spec", "eagle3"}
