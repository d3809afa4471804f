import pytest

from specserve.config import ConfigError, load_config, parse_config, revision_of
from specserve.engine.arm import build_llm_config
from specserve.settings import DEFAULT_CONFIG_PATH

BASE = """
model: {name: m, source: /models/m, accelerator: cpu}
arms:
  - {name: no-spec, weight: 1}
  - name: ngram
    weight: 1
    speculative: {method: ngram, num_speculative_tokens: 3}
"""


def test_default_config_is_valid():
    loaded = load_config(DEFAULT_CONFIG_PATH)
    assert {a.name for a in loaded.config.arms} == {"no-spec", "ngram", "eagle3", "eagle3.1"}
    assert loaded.revision == revision_of(DEFAULT_CONFIG_PATH.read_bytes())


def test_minimal_config_gets_defaults():
    config = parse_config(BASE)
    assert config.routing.session_header == "x-session-id"
    assert config.arm("no-spec").speculative.method == "none"
    assert config.weights == {"no-spec": 1.0, "ngram": 1.0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("arms: [", "not valid YAML"),
        ("- a\n- b", "mapping at the top level"),
        (BASE.replace("weight: 1}", "weight: -1}"), "`arms.0.weight`"),
        (
            BASE.replace("num_speculative_tokens: 3", "num_speculative_tokens: 0"),
            "num_speculative_tokens",
        ),
        (BASE.replace("method: ngram", "method: medusa"), "arms.1.speculative"),
        (
            BASE.replace("num_speculative_tokens", "num_draft_tokens"),
            "renamed to `num_speculative_tokens`",
        ),
        (BASE.replace("name: ngram", "name: no-spec"), "duplicate arm names"),
        (BASE.replace("name: ngram", "name: Bad_Name"), "arms.1.name"),
        (
            BASE.replace("weight: 1}", "weight: 0}").replace("weight: 1\n", "weight: 0\n"),
            "weight > 0",
        ),
        (BASE + "extra: 1\n", "`extra`"),
        (
            BASE.replace(
                "{name: no-spec, weight: 1}", "{name: no-spec, weight: 1, engine: {model: x}}"
            ),
            "`model.source`",
        ),
        ("model: {name: m, source: s}\narms: []\n", "`arms`"),
    ],
)
def test_invalid_configs_name_the_field(text, message):
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="cfg.yaml")
    assert message in str(info.value)
    assert str(info.value).startswith("cfg.yaml: ")


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_engine_args_leave_out_weight_and_unset_defaults():
    config = parse_config(BASE)
    heavier = parse_config(BASE.replace("{name: no-spec, weight: 1}", "{name: no-spec, weight: 9}"))
    assert [a.engine_args() for a in config.arms] == [a.engine_args() for a in heavier.arms]
    assert config.arm("ngram").engine_args() == {
        "name": "ngram",
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
    }


def test_llm_config_carries_speculation_and_per_request_stats():
    config = parse_config(BASE)
    ngram = build_llm_config(config.arm("ngram"), config.model)
    spec = ngram.engine_kwargs["speculative_config"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    assert ngram.engine_kwargs["per_request_spec_decode_metrics"] == "summary"
    plain = build_llm_config(config.arm("no-spec"), config.model)
    # vLLM rejects per-request spec-decode stats without speculation.
    assert "speculative_config" not in plain.engine_kwargs
    assert "per_request_spec_decode_metrics" not in plain.engine_kwargs
    assert plain.model_id == "m"


def test_cpu_arms_default_to_the_cpus_fast_dtype_and_keep_an_explicit_one(monkeypatch):
    from specserve import hardware

    config = parse_config(BASE)
    assert config.model.accelerator == "cpu"
    for flags, dtype in ((set(), "float32"), ({"avx512f", "avx512_bf16"}, "bfloat16")):
        monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert build_llm_config(config.arm("ngram"), config.model).engine_kwargs["dtype"] == dtype
    explicit = config.arm("ngram").model_copy(update={"engine": {"dtype": "float16"}})
    assert build_llm_config(explicit, config.model).engine_kwargs["dtype"] == "float16"
    gpu = parse_config(BASE.replace("accelerator: cpu", "accelerator: gpu"))
    assert "dtype" not in build_llm_config(gpu.arm("ngram"), gpu.model).engine_kwargs


def test_eagle3_arm_passes_the_drafter():
    text = BASE.replace(
        "{method: ngram, num_speculative_tokens: 3}",
        "{method: eagle3, model: /drafters/e31, num_speculative_tokens: 4}",
    )
    config = parse_config(text)
    spec = build_llm_config(config.arm("ngram"), config.model).engine_kwargs["speculative_config"]
    assert spec == {"method": "eagle3", "model": "/drafters/e31", "num_speculative_tokens": 4}


def test_packaged_drafter_resolves_or_names_what_is_shipped(tmp_path, monkeypatch):
    from specserve import models

    monkeypatch.setattr(models, "PACKAGED_DRAFTERS_DIR", tmp_path)
    (tmp_path / "eagle3.1").mkdir()
    (tmp_path / "eagle3.1" / "config.json").write_text("{}")
    assert models.resolve_drafter_source("package://eagle3.1") == str(tmp_path / "eagle3.1")
    assert models.resolve_drafter_source("/abs/dir") == "/abs/dir"
    with pytest.raises(models.ModelError, match=r"shipped: \['eagle3.1'\]"):
        models.resolve_drafter_source("package://nope")


def test_default_config_eagle_arms_point_at_shipped_drafters():
    config = load_config(DEFAULT_CONFIG_PATH).config
    model = config.model.model_copy(update={"source": "/models/m"})  # no model prep needed
    for name in ("eagle3", "eagle3.1"):
        spec = build_llm_config(config.arm(name), model).engine_kwargs["speculative_config"]
        assert spec["method"] == "eagle3"
        assert spec["model"].endswith(f"specserve/drafters/{name}")


def test_serve_config_is_the_router_app_plus_one_app_per_arm_without_weights():
    from ray.serve.schema import ServeDeploySchema

    from specserve.serve_config import serve_config

    config = parse_config(BASE)
    heavier = parse_config(BASE.replace("{name: no-spec, weight: 1}", "{name: no-spec, weight: 9}"))
    document = serve_config(config, config_path="/etc/specserve/config.yaml")
    ServeDeploySchema.model_validate(document)  # what `serve deploy` and KubeRay accept
    names = [app["name"] for app in document["applications"]]
    assert names == ["specserve", "arm-no-spec", "arm-ngram"]
    assert document["applications"][0]["args"]["config_path"] == "/etc/specserve/config.yaml"
    # A weight change leaves the Serve config as it is: Ray Serve redeploys nothing.
    assert serve_config(heavier) == serve_config(config)
    ngram = document["applications"][2]
    # The arm's route, where the dispatch sends its requests; clients only with `expose_arms`.
    assert ngram["route_prefix"] == "/arms/ngram"
    assert "expose_http" not in ngram["args"]
    assert ngram["args"]["arm"]["speculative"]["num_speculative_tokens"] == 3


def test_replica_and_queue_settings_are_deployment_options_outside_the_builders_args():
    """Ray Serve builds an application again, restarting its engines, when its args change;
    options of its deployments it applies to the running replicas."""
    from ray.serve.schema import ServeDeploySchema

    from specserve.serve_config import serve_config

    scaled_text = BASE.replace(
        "{name: no-spec, weight: 1}",
        "{name: no-spec, weight: 1, replicas: 2, max_queued_requests: 8, max_surge_percent: 100}",
    )
    plain, scaled = serve_config(parse_config(BASE)), serve_config(parse_config(scaled_text))
    ServeDeploySchema.model_validate(scaled)
    before, after = plain["applications"][1], scaled["applications"][1]
    assert after["args"] == before["args"]
    assert "deployments" not in before  # nothing set: the builder's defaults
    assert after["deployments"] == [
        {
            "name": "arm-no-spec",
            "num_replicas": 2,
            "max_queued_requests": 8,
            "max_surge_percent": 100,
        }
    ]
    assert scaled["applications"][2] == plain["applications"][2]


def test_an_arms_capacity_per_proxy_is_its_replicas_full_and_its_queue_full():
    from specserve.engine.arm import deployment_config

    text = BASE.replace(
        "{name: no-spec, weight: 1}",
        "{name: no-spec, weight: 1, replicas: 2, max_queued_requests: 8,"
        " engine: {max_num_seqs: 16}}",
    ).replace("weight: 1\n", "weight: 1\n    max_ongoing_requests: 3\n")
    batching, bounded = parse_config(text).arm("no-spec"), parse_config(text).arm("ngram")
    unset = parse_config(BASE).arm("no-spec")
    assert batching.capacity_per_proxy() == 2 * 16 + 8  # ongoing: what the engine batches
    assert bounded.capacity_per_proxy() == 3 + 64
    assert unset.capacity_per_proxy() == 256 + 64  # vLLM's default batch, the default queue
    for arm in (batching, bounded, unset):  # the bounds Ray Serve is given
        options = deployment_config(arm)
        assert arm.capacity_per_proxy() == (
            options["num_replicas"] * options["max_ongoing_requests"]
            + options["max_queued_requests"]
        )


def test_arm_builder_takes_the_plain_args_the_serve_config_gives_it():
    import ray

    from specserve.engine.arm import build_app
    from specserve.serve_config import arm_application

    config = parse_config(BASE)
    try:
        app = build_app(arm_application(config.arm("ngram"), config)["args"])
    finally:
        ray.shutdown()  # Ray Serve LLM starts a local Ray to build the deployment
    deployment = app._bound_deployment  # the LLMServer deployment with its engine config
    assert deployment.name == "arm-ngram"
