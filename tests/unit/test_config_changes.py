"""One classification of config changes: `specserve config diff` and `config apply` (the arm
applications it writes into a RayService's serveConfigV2) say the same about every arm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specserve.config.changes import diff_configs
from specserve.config.schema import parse_config
from specserve.config.serve_config import (
    application_change,
    application_changes,
    arm_app_name,
    arm_applications,
    arm_of_application,
    merge_arm_applications,
    serve_config,
)

DEFAULT = (Path(__file__).parents[2] / "service/specserve/configs/default.yaml").read_text()
NGRAM_DEFAULTS = ", prompt_lookup_max: 4, prompt_lookup_min: 2"
NO_SPEC = "    weight: 25\n    speculative: {method: none}\n"


def edit(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


# (name, new config, what happens to each arm: arm -> "restart" | "in place" | "removed")
CASES = [
    (
        "defaults written out or left out",
        edit(
            edit(
                DEFAULT,
                NO_SPEC,
                "    weight: 25\n    replicas: 1\n    speculative: {method: none}\n",
            ),
            NGRAM_DEFAULTS,
            "",
        ),
        {},
    ),
    (
        "a weight",
        edit(DEFAULT, "- name: ngram\n    weight: 25", "- name: ngram\n    weight: 5"),
        {},
    ),
    (
        "a capture sample turned on (live, in the router)",
        edit(
            DEFAULT,
            "- name: ngram\n    weight: 25",
            "- name: ngram\n    weight: 25\n    capture: {sample: 0.05}",
        ),
        {},
    ),
    (
        "replicas",
        edit(
            DEFAULT, NO_SPEC, "    weight: 25\n    replicas: 2\n    speculative: {method: none}\n"
        ),
        {"no-spec": "in place"},
    ),
    (
        "a drafter's k, with the n-gram defaults dropped",
        edit(
            edit(
                DEFAULT,
                'model: "package://eagle3"\n      num_speculative_tokens: 3',
                'model: "package://eagle3"\n      num_speculative_tokens: 4',
            ),
            NGRAM_DEFAULTS,
            "",
        ),
        {"eagle3": "restart"},
    ),
    (
        "an n-gram setting off its default",
        edit(DEFAULT, "prompt_lookup_max: 4", "prompt_lookup_max: 5"),
        {"ngram": "restart"},
    ),
    (
        "an arm removed, another added",
        DEFAULT.split("  - name: eagle3.1")[0]
        + "  - name: ngram-k5\n    weight: 10\n"
        + "    speculative: {method: ngram, num_speculative_tokens: 5}\n",
        {"eagle3.1": "removed", "ngram-k5": "restart"},
    ),
    (
        "an EAGLE arm's drafter weights (loaded by the running engines)",
        edit(
            DEFAULT,
            "  - name: eagle3.1\n    weight: 25\n",
            "  - name: eagle3.1\n    weight: 25\n    drafter_weights: /drafters/e-0123\n",
        ),
        {"eagle3.1": "in place"},
    ),
    (
        "the model",
        edit(DEFAULT, "max_model_len: 4096", "max_model_len: 2048"),
        {"no-spec": "restart", "ngram": "restart", "eagle3": "restart", "eagle3.1": "restart"},
    ),
]


def diff_says(old: str, new: str) -> dict[str, str]:
    """Per arm, what `config diff` prints: restart, in place (engines), removed; weights are
    live and left out."""
    found: dict[str, str] = {}
    lines = diff_configs(parse_config(old), parse_config(new))
    redeploy_all = any("(redeploys all)" in line for line in lines)
    for line in lines:
        if match := re.match(r"([-+~]) arm (\S+) (.*)", line):
            sign, arm, rest = match.groups()
            if sign == "-":
                found[arm] = "removed"
            elif sign == "+" or "(redeploys this arm)" in rest:
                found[arm] = "restart"
            elif "(applied to the running engines)" in rest:
                found.setdefault(arm, "in place")
    if redeploy_all:
        found.update({arm.name: "restart" for arm in parse_config(new).arms})
    return found


def apply_does(old: str, new: str) -> dict[str, str]:
    """Per arm, what `config apply` does to the RayService serving `old`."""
    document = serve_config(parse_config(old), config_poll_s=2.0)
    merged = merge_arm_applications(document, parse_config(new))
    changes = application_changes(document, merged)
    arms = {
        arm_app_name(a.name): a.name for a in [*parse_config(old).arms, *parse_config(new).arms]
    }
    found = {arms[app]: "restart" for app in changes.redeployed}
    found |= {arms[app]: "in place" for app in (*changes.rescaled, *changes.reloaded)}
    found |= {arms[app]: "removed" for app in changes.removed}
    if not changes:
        assert merged == document  # nothing changed: nothing is written
    return found


@pytest.mark.parametrize(("name", "new", "expected"), CASES, ids=[c[0] for c in CASES])
def test_diff_and_apply_classify_every_arm_alike(name, new, expected):
    assert new != DEFAULT
    assert diff_says(DEFAULT, new) == expected
    assert apply_does(DEFAULT, new) == expected


def test_a_capture_change_is_said_to_apply_live():
    lines = diff_configs(parse_config(DEFAULT), parse_config(CASES[2][1]))
    assert lines == ["~ arm ngram capture changed (live)"]


def test_defaults_written_out_are_no_change_at_all():
    new = CASES[0][1]
    assert diff_configs(parse_config(DEFAULT), parse_config(new)) == []


def test_an_in_place_change_keeps_the_running_engine_arguments():
    """Replicas changed and the n-gram defaults dropped: the arm's args stay as they run (a new
    spelling of them would make Ray Serve restart its engines); only its options change."""
    new = edit(
        edit(DEFAULT, NGRAM_DEFAULTS, ""),
        "    speculative: {method: ngram, num_speculative_tokens: 3}\n",
        "    speculative: {method: ngram, num_speculative_tokens: 3}\n    replicas: 2\n",
    )
    document = serve_config(parse_config(DEFAULT))
    merged = merge_arm_applications(document, parse_config(new))
    before = {a["name"]: a for a in document["applications"]}["arm-ngram"]
    after = {a["name"]: a for a in merged["applications"]}["arm-ngram"]
    assert after["args"] == before["args"]
    assert after["deployments"][0]["num_replicas"] == 2
    assert application_changes(document, merged).rescaled == ("arm-ngram",)


def test_drafter_weights_reach_the_running_engines_as_user_config_and_read_back():
    """Set, changed or dropped, `drafter_weights` changes the arm's `user_config` only (Ray
    Serve reconfigures the running replicas); dropped, it is null, which tells the replicas to
    load their own drafter's weights back."""
    new = CASES[-2][1]
    old_app, new_app = (
        arm_applications(serve_config(parse_config(text)))["arm-eagle3.1"]
        for text in (DEFAULT, new)
    )
    assert old_app["args"] == new_app["args"]
    assert old_app["deployments"][0]["user_config"] == {"drafter_weights": None}
    assert new_app["deployments"][0]["user_config"] == {"drafter_weights": "/drafters/e-0123"}
    _, arm = arm_of_application(new_app)
    assert arm.drafter_weights == "/drafters/e-0123"
    change = application_change(new_app, old_app)
    assert change.kind == "in place" and change.in_place == ("drafter_weights",)
    assert diff_configs(parse_config(DEFAULT), parse_config(new)) == [
        "~ arm eagle3.1 drafter_weights changed (applied to the running engines)"
    ]
