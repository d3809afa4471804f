"""A/B split, stickiness, overrides and live weight changes through the real router."""

import concurrent.futures as cf
from collections import Counter

import httpx

from specserve import headers
from tests.conftest import MODEL, render_config

BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}


def arm_of(live, *, session=None, user=None, override=None, client=None) -> str:
    hdrs = {}
    if session is not None:
        hdrs["x-session-id"] = session
    if override is not None:
        hdrs[headers.ARM_OVERRIDE] = override
    body = dict(BODY, user=user) if user is not None else BODY
    response = (client or live.http).post("/v1/completions", json=body, headers=hdrs)
    assert response.status_code == 200, response.text
    return response.headers[headers.ARM]


def many(live, n, request_kwargs):
    """Send n requests, 8 at a time; request i uses request_kwargs(i). Returns the arms."""
    with (
        httpx.Client(base_url=live.base_url, timeout=120, headers=live.auth) as client,
        cf.ThreadPoolExecutor(8) as pool,
    ):
        return list(pool.map(lambda i: arm_of(live, client=client, **request_kwargs(i)), range(n)))


def test_split_follows_weights_over_many_keys(live, restore_config):
    live.write_config(render_config(no_spec_weight=1, ngram_weight=3))
    n = 240
    counts = Counter(many(live, n, lambda i: {"session": f"split-{i}"}))
    p = 3 / 4
    sigma = (p * (1 - p) / n) ** 0.5
    share = counts["ngram"] / n
    assert abs(share - p) < 4 * sigma, (counts, p)


def test_session_header_and_user_field_are_sticky(live):
    for key in ("alice", "bob", "carol", "dave"):
        assert len({arm_of(live, session=key) for _ in range(5)}) == 1
        assert len({arm_of(live, user=key) for _ in range(5)}) == 1
    # The session header wins over the user field.
    by_session = arm_of(live, session="erin")
    assert {arm_of(live, session="erin", user=f"u{i}") for i in range(6)} == {by_session}


def test_override_beats_stickiness(live):
    sticky = arm_of(live, session="frank")
    other = "ngram" if sticky == "no-spec" else "no-spec"
    assert arm_of(live, session="frank", override=other) == other


def test_weight_change_moves_traffic_live_without_dropping_requests(live, restore_config):
    pool = cf.ThreadPoolExecutor(4)
    with httpx.Client(base_url=live.base_url, timeout=120, headers=live.auth) as client:
        # Keep requests in flight across both swaps.
        background = [
            pool.submit(lambda i=i: client.post("/v1/completions", json=BODY).status_code)
            for i in range(60)
        ]
        live.write_config(render_config(no_spec_weight=0, ngram_weight=1))
        assert set(many(live, 24, lambda i: {"session": f"live-{i}"})) == {"ngram"}
        live.write_config(render_config(no_spec_weight=1, ngram_weight=0))
        assert set(many(live, 24, lambda i: {"session": f"live-{i}"})) == {"no-spec"}
        # A zero-weight arm is still reachable by override.
        assert arm_of(live, override="ngram") == "ngram"
        statuses = [f.result() for f in background]
    pool.shutdown()
    assert statuses == [200] * len(statuses)
