from specserve.metrics import RouterMetrics


def test_spec_decode_stats_become_counters_per_arm_and_position():
    metrics = RouterMetrics()
    # 4 verify steps at k=3: accepted 0, 2, 3 and 3 draft tokens.
    stats = {
        "acceptance_histogram": [1, 0, 1, 2],
        "num_spec_steps": 4,
        "num_accepted_draft_tokens": 8,
        "num_draft_tokens": 12,
        "num_spec_tokens": 3,
    }
    metrics.observe_spec_decode("ngram", stats)
    get = metrics.registry.get_sample_value
    assert get("specserve_spec_drafts_total", {"arm": "ngram"}) == 4
    assert get("specserve_spec_draft_tokens_total", {"arm": "ngram"}) == 12
    assert get("specserve_spec_accepted_tokens_total", {"arm": "ngram"}) == 8
    per_position = [
        get(
            "specserve_spec_accepted_tokens_per_position_total",
            {"arm": "ngram", "position": str(p)},
        )
        for p in range(3)
    ]
    assert per_position == [3, 3, 2]
    assert sum(per_position) == 8  # positions add up to the accepted total
    # vLLM's mean acceptance length, as docs/metrics.md computes it in PromQL.
    assert 1 + 8 / 4 == 3.0


def test_active_config_replaces_old_revision_and_weights():
    metrics = RouterMetrics()
    metrics.set_active_config("aaa", {"x": 1, "y": 2})
    metrics.set_active_config("bbb", {"x": 3})
    get = metrics.registry.get_sample_value
    assert get("specserve_config_info", {"revision": "aaa"}) is None
    assert get("specserve_config_info", {"revision": "bbb"}) == 1
    assert get("specserve_arm_weight", {"arm": "x"}) == 3
    assert get("specserve_arm_weight", {"arm": "y"}) is None
