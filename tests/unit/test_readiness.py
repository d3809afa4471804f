from specserve.config.schema import parse_config
from specserve.readiness import Readiness, readiness

CONFIG = parse_config(
    "model: {name: m, source: s}\narms:\n  - {name: a, weight: 1}\n  - {name: b, weight: 0}\n"
)


def test_ready_when_every_weighted_arm_runs_and_nothing_drains():
    assert readiness(CONFIG, "r1", {"a": "RUNNING"}, draining=False).ready
    waiting = readiness(CONFIG, "r1", {"b": "RUNNING"}, draining=False)
    assert not waiting.ready and waiting.waiting == {"a": "NOT_DEPLOYED"}
    assert not readiness(CONFIG, "r1", {"a": "RUNNING"}, draining=True).ready
    assert not readiness(None, "r1", {}, draining=False).ready


def test_the_body_reads_back_as_it_was_sent():
    for found in (
        readiness(CONFIG, "r1", {"a": "DEPLOYING"}, draining=False),
        Readiness("r1", dispatch=False, error="no dispatch"),
    ):
        body = found.body()
        assert body["ready"] is found.ready
        assert Readiness.from_body(body) == found
