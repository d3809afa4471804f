"""An engine-level change redeploys only the arm it touches: the platform hands Ray Serve the
whole Serve config and Ray Serve finds the one application that changed, and the other arms
serve on without dropping a request. The changed arm (`max_surge_percent: 100`) serves on too:
its old engine answers until the new one runs. Disruptive (it restarts an engine): it runs after
the tests that use the platform, and puts k back whatever happens (the engine too, where a test
after it uses the platform)."""

import pytest

from specserve import headers
from specserve.config.schema import load_config
from tests.conftest import MODEL, platform_used_after, render_config
from tests.integration.serving import replica_actors, steady_traffic

pytestmark = pytest.mark.disruptive

PAUSE_S = 1.5  # between one arm's requests while the new engine starts


# The new engine's start, then the old k's restored: up to 600 + 300 s (the waits below).
@pytest.mark.timeout(900)
def test_changing_k_redeploys_only_that_arm(live, restore_config, request):
    no_spec_before = replica_actors("arm-no-spec")
    ngram_before = replica_actors("arm-ngram")
    assert no_spec_before and ngram_before

    try:
        redeploy_with_k2_under_traffic(live, no_spec_before, ngram_before)
    finally:
        # Put k back for any test that runs after and uses the platform, even after a failure.
        live.write_config(render_config())
        if platform_used_after(request):
            live.platform.deploy(load_config(live.config_path))
            live.platform.wait_until_running(timeout_s=300)


def redeploy_with_k2_under_traffic(live, no_spec_before: set, ngram_before: set) -> None:
    # The new engine starts on the core its predecessor serves from, and vLLM's worker polls for
    # its next step without sleeping for 1 s after each (shm_broadcast's busy loop): requests
    # more than a second apart leave that core to the start between them. With 0.2 s apart, the
    # start took 90-108 s in three runs on a 2-core machine and 278-293 s in four others.
    with (
        steady_traffic(live, "no-spec", pause_s=PAUSE_S) as other,
        steady_traffic(live, "ngram", pause_s=PAUSE_S) as changed,
    ):
        live.write_config(render_config(k=2))
        live.platform.deploy(load_config(live.config_path))
        live.platform.wait_until_running(timeout_s=600)
    print(f"while ngram redeployed: no-spec served {len(other)}, ngram {len(changed)} requests")
    assert len(other) >= 5 and set(other) == {200}  # none dropped on the other arm
    assert len(changed) >= 5 and set(changed) == {200}  # nor on the arm being redeployed

    assert replica_actors("arm-no-spec") == no_spec_before
    assert replica_actors("arm-ngram").isdisjoint(ngram_before)
    r = live.http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "a b a b a b"}],
            "max_tokens": 8,
        },
        headers={headers.ARM_OVERRIDE: "ngram"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["metrics"]["speculative_decoding"]["num_spec_tokens"] == 2
