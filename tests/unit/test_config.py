import re

import pytest

from specserve.config.schema import ConfigError, load_config, parse_config, revision_of
from specserve.config.serve_config import ARM_NAME_ENV
from specserve.config.settings import DEFAULT_CONFIG_PATH
from specserve.engine.arm import build_llm_config

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
        (
            BASE.replace("{name: no-spec, weight: 1}", "{name: no-spec, weight: 1, capture: {}}"),
            "arms.0.capture.sample",
        ),
        (
            BASE.replace(
                "{name: no-spec, weight: 1}", "{name: no-spec, weight: 1, capture: {sample: 0}}"
            ),
            "arms.0.capture.sample",
        ),
        (
            BASE.replace(
                "{name: no-spec, weight: 1}",
                "{name: no-spec, weight: 1, capture: {sample: 0.1, max_age_s: .inf}}",
            ),
            "arms.0.capture.max_age_s",
        ),
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


def test_capture_is_the_routers_and_never_reaches_the_engine():
    captured = parse_config(
        BASE.replace(
            "{name: no-spec, weight: 1}", "{name: no-spec, weight: 1, capture: {sample: 0.05}}"
        )
    )
    arm = captured.arm("no-spec")
    assert arm.capture.sample == 0.05 and arm.capture.max_records == 100_000
    assert arm.engine_args() == parse_config(BASE).arm("no-spec").engine_args()
    assert "capture" not in str(build_llm_config(arm, captured.model).model_dump())


@pytest.mark.parametrize(
    ("source", "node_step"),
    [("/models/m", False), ("HuggingFaceTB/SmolLM2-135M-Instruct", False), ("s3://b/m", True)],
)
def test_an_engine_skips_ray_serve_llms_node_step_unless_its_model_is_in_a_bucket(
    source, node_step
):
    """The per-node step copies a bucket's files; without one it only costs a process start."""
    import asyncio

    config = parse_config(BASE.replace("/models/m", source))
    llm_config = build_llm_config(config.arm("no-spec"), config.model)
    callback = llm_config.callback_config.callback_class(llm_config=llm_config)
    asyncio.run(callback.run_callback("on_before_node_init"))
    assert callback.ctx.run_init_node is node_step


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
    # Every process of an arm says which arm it serves (vLLM's run under their own names).
    assert plain.runtime_env["env_vars"] == {ARM_NAME_ENV: "no-spec"}


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
    assert spec == {
        "method": "eagle3",
        "model": "/drafters/e31",
        "num_speculative_tokens": 4,
        "use_local_argmax_reduction": True,  # specserve's default (docs/config.md)
    }


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

    from specserve.config.serve_config import serve_config

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

    from specserve.config.serve_config import serve_config

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


@pytest.mark.ray
def test_arm_builder_takes_the_plain_args_the_serve_config_gives_it():
    import ray

    from specserve.config.serve_config import arm_application
    from specserve.engine.arm import build_app

    config = parse_config(BASE)
    # Ray Serve LLM joins the Ray of this process to build the deployment, or starts a local one,
    # which is ended after; one it did not start (the session platform's) is left running.
    started_here = not ray.is_initialized()
    try:
        app = build_app(arm_application(config.arm("ngram"), config)["args"])
    finally:
        if started_here:
            ray.shutdown()
    deployment = app._bound_deployment  # the LLMServer deployment with its engine config
    assert deployment.name == "arm-ngram"


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def arm_text(extra: str) -> str:
    """BASE with `extra` (a flow mapping's inside) added to the no-spec arm."""
    return BASE.replace("{name: no-spec, weight: 1}", "{name: no-spec, weight: 1, " + extra + "}")


@pytest.mark.parametrize("number", [".inf", "-.inf", ".nan", ".NaN", "1.0e400"])
@pytest.mark.parametrize(
    ("section", "where"),
    [
        ("limits: {request_timeout_s: %s}", "limits.request_timeout_s"),
        ("guardrail: {window_s: %s}", "guardrail.window_s"),
        ("guardrail: {drain_s: %s}", "guardrail.drain_s"),
        ("guardrail: {min_acceptance_length: %s}", "guardrail.min_acceptance_length"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_field(number, section, where):
    with pytest.raises(ConfigError, match=f"`{where}`: Input should be a finite number"):
        parse_config(BASE + section % number + "\n")


@pytest.mark.parametrize("number", [".inf", ".nan"])
def test_a_non_finite_weight_or_engine_number_is_refused(number):
    """An infinite weight made every weighted request fail (500) in arm selection."""
    with pytest.raises(ConfigError, match="`arms.0.weight`: Input should be a finite number"):
        parse_config(
            BASE.replace("{name: no-spec, weight: 1}", f"{{name: no-spec, weight: {number}}}")
        )
    text = arm_text(f"engine: {{gpu_memory_utilization: {number}}}")
    with pytest.raises(ConfigError, match="`gpu_memory_utilization` must be a finite number"):
        parse_config(text)
    text = arm_text(f"engine: {{compilation_config: {{pass_config: {{x: [{number}]}}}}}}")
    with pytest.raises(ConfigError, match=r"`compilation_config.pass_config.x.0` must be a finite"):
        parse_config(text)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (arm_text("weight: 1e7").replace("weight: 1, weight", "weight"), "arms.0.weight"),
        (arm_text("replicas: 100000"), "arms.0.replicas"),
        (arm_text("max_ongoing_requests: 1000000"), "arms.0.max_ongoing_requests"),
        (arm_text("max_queued_requests: 1000000"), "arms.0.max_queued_requests"),
        (BASE + "limits: {max_tokens: 100000000}\n", "limits.max_tokens"),
        (BASE + "limits: {max_n: 1000}\n", "limits.max_n"),
        (BASE + "limits: {max_body_bytes: 1000000000}\n", "limits.max_body_bytes"),
        (BASE + "limits: {request_timeout_s: 1.0e6}\n", "limits.request_timeout_s"),
        (BASE + "guardrail: {window_s: 1.0e6}\n", "guardrail.window_s"),
        (BASE + "guardrail: {drain_s: 1.0e6}\n", "guardrail.drain_s"),
        (BASE + "guardrail: {min_acceptance_length: 18}\n", "guardrail.min_acceptance_length"),
    ],
)
def test_absurd_numbers_are_refused_naming_the_field(text, where):
    with pytest.raises(ConfigError, match=f"`{where}`: Input should be less than or equal to"):
        parse_config(text)


def test_the_largest_allowed_numbers_pass():
    text = arm_text(
        "replicas: 1024, max_ongoing_requests: 100000, max_queued_requests: 100000"
    ).replace("weight: 1}", "weight: 1000000}", 1)
    text += (
        "limits: {max_tokens: 1048576, max_n: 128, max_body_bytes: 100000000, "
        "request_timeout_s: 86400}\n"
        "guardrail: {min_acceptance_length: 17, window_s: 86400, drain_s: 86400}\n"
    )
    config = parse_config(text)
    assert config.arms[0].replicas == 1024 and config.limits.max_n == 128


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("X-Session-Id", "not a lower-case HTTP header name"),
        ("'x session'", "not a lower-case HTTP header name"),
        ("''", "not a lower-case HTTP header name"),
        ("x-" + "a" * 70, "not a lower-case HTTP header name"),
        ("authorization", "carries credentials"),
        ("cookie", "carries credentials"),
        ("x-request-id", "differs on every request"),
        ("x-specserve-arm", "`x-specserve-*` headers are the platform's"),
        ("x-specserve-request-timeout-s", "`x-specserve-*` headers are the platform's"),
    ],
)
def test_session_header_must_be_a_header_that_can_pin_sessions(header, message):
    with pytest.raises(ConfigError, match="`routing.session_header`: .*" + re.escape(message)):
        parse_config(BASE + f"routing: {{session_header: {header}}}\n")


def test_a_custom_session_header_passes():
    assert parse_config(BASE + "routing: {session_header: x-user_session.v2}\n")


BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_a_yaml_alias_bomb_is_refused_at_once():
    """Nine levels of nine aliases: under 700 bytes standing for 9^9 (387 million) strings."""
    import time

    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^bomb.yaml: refused: its aliases expand to more than"):
        parse_config(BILLION_LAUGHS, source="bomb.yaml")
    assert time.perf_counter() - start < 0.2
    # Hidden where only the engine check and the Serve config would expand it.
    hidden = BILLION_LAUGHS.replace("i: &i", "arms:\n  - {name: a, weight: 1, engine: {x: &i")
    with pytest.raises(ConfigError, match="alias bomb"):
        parse_config(hidden.rstrip() + "}}\n")


def test_anchors_shared_by_a_few_arms_pass():
    text = BASE.replace(
        "{name: no-spec, weight: 1}",
        "{name: no-spec, weight: 1, engine: &engine {enforce_eager: true, max_num_seqs: 16},"
        " env: &env {OMP_NUM_THREADS: '2'}}",
    ).replace("weight: 1\n", "weight: 1\n    engine: *engine\n    env: *env\n")
    config = parse_config(text)
    assert (
        config.arm("ngram").engine
        == config.arm("no-spec").engine
        == {
            "enforce_eager": True,
            "max_num_seqs": 16,
        }
    )
    assert config.arm("ngram").env == {"OMP_NUM_THREADS": "2"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: &a [*a]\n", "alias \\*a is inside its own anchor"),
        ("a: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than 32 levels"),
        ("a: '" + "x" * (1 << 20) + "'\n", "bytes, more than 1048576"),
    ],
)
def test_recursive_deep_or_huge_documents_are_refused(text, message):
    with pytest.raises(ConfigError, match="^cfg.yaml: refused: .*" + message):
        parse_config(text, source="cfg.yaml")


def test_a_huge_file_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "config.yaml"
    with path.open("wb") as file:
        file.truncate(1 << 30)  # sparse: 1 GiB of zeros
    with pytest.raises(ConfigError, match="refused: more than 1048576 bytes"):
        load_config(path)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ("{trust_remote_code: true}", "`trust_remote_code` runs the Python code that ships"),
        ("{worker_extension_cls: m.C}", "`worker_extension_cls` names a Python class"),
        ("{worker_cls: m.C}", "`worker_cls` names a Python class"),
        ("{logits_processors: [m.C]}", "`logits_processors` names Python classes"),
        ("{hf_overrides: {architectures: [X]}}", "`hf_overrides` rewrites the checkpoint"),
        ("{load_format: pt}", "`load_format` some formats unpickle"),
        ("{hf_token: hf_x}", "`hf_token` a secret"),
        ("{max_num_seq: 16}", "`max_num_seq` is not on the engine allow-list \\(did you mean "),
        ("{tokenizer: org/t}", "`tokenizer` is not on the engine allow-list"),
        (
            "{compilation_config: {backend: m.f}}",
            "`compilation_config` sets backend: `backend` and `inductor_passes` name Python",
        ),
        ('{compilation_config: \'{"backend": "m.f"}\'}', "`compilation_config` sets {"),
    ],
)
def test_engine_settings_that_load_code_need_the_operators_opt_in(engine, message):
    with pytest.raises(ConfigError) as info:
        parse_config(arm_text(f"engine: {engine}"))
    assert "`arms.0.engine`: " + message.replace("\\", "") in str(info.value).replace("\\", "")
    assert "name it in `allow_code_loading.engine`" in str(info.value)


def test_an_opt_in_names_each_setting_it_allows():
    key = engine = "trust_remote_code"
    allowed = parse_config(
        arm_text(f"engine: {{{engine}: true}}, allow_code_loading: {{engine: [{key}]}}")
    )
    arm = allowed.arm("no-spec")
    assert arm.engine == {"trust_remote_code": True}
    # The arm's builder reads its args alone (serve_config): the opt-in travels with them, and
    # without it the builder refuses the setting too.
    from specserve.config.schema import ArmEngineConfig

    assert ArmEngineConfig.model_validate(arm.engine_args()).engine == arm.engine
    without = {k: v for k, v in arm.engine_args().items() if k != "allow_code_loading"}
    with pytest.raises(ValueError, match="trust_remote_code"):
        ArmEngineConfig.model_validate(without)
    # Another name allows nothing else, and a name the arm does not set is refused.
    with pytest.raises(ConfigError, match="`worker_cls` names a Python class"):
        parse_config(
            arm_text(
                "engine: {trust_remote_code: true, worker_cls: m.C},"
                " allow_code_loading: {engine: [trust_remote_code]}"
            )
        )
    with pytest.raises(
        ConfigError,
        match="`allow_code_loading.engine` names trust_remote_code, which this arm's `engine`",
    ):
        parse_config(arm_text("allow_code_loading: {engine: [trust_remote_code]}"))
    with pytest.raises(ConfigError, match="`arms.0.allow_code_loading.engine`"):
        parse_config(arm_text("allow_code_loading: {engine: '*'}"))


def test_trust_remote_code_on_an_eagle_arm_needs_the_opt_in_for_its_drafters_code_too():
    """vLLM passes trust_remote_code on to the draft model config: the drafter's checkpoint's
    code runs as well as the target's."""
    eagle = (
        "speculative: {method: eagle3, model: org/drafter, num_speculative_tokens: 3}, "
        "engine: {trust_remote_code: true}, allow_code_loading: {engine: [trust_remote_code]"
    )
    with pytest.raises(ConfigError, match="also runs the code that ships with the drafter"):
        parse_config(arm_text(eagle + "}"))
    pinned = eagle.replace(
        "num_speculative_tokens: 3", f"num_speculative_tokens: 3, revision: {COMMIT}"
    )
    arm = parse_config(arm_text(pinned + ", drafter: true}")).arm("no-spec")
    assert arm.allow_code_loading.drafter
    # Its builder, which reads the arm's args alone, holds it to the same.
    from specserve.config.schema import ArmEngineConfig

    assert ArmEngineConfig.model_validate(arm.engine_args()).allow_code_loading.drafter
    # Without trust_remote_code the drafter's code never runs: nothing to opt in to.
    plain = "speculative: {method: eagle3, model: org/drafter, num_speculative_tokens: 3}"
    assert not parse_config(arm_text(plain)).arm("no-spec").allow_code_loading.drafter


def test_code_from_a_hub_repository_runs_only_from_a_pinned_commit():
    """With trust_remote_code an engine runs the code in the target's and the drafter's hub
    repositories: whoever can push there would run theirs. Each such source is pinned to a
    commit, which reaches vLLM for the weights, the tokenizer and the code."""
    code = "engine: {trust_remote_code: true}, allow_code_loading: {engine: [trust_remote_code]"
    hub = "source: org/model"
    pinned = f"source: org/model, revision: '{COMMIT}'"
    with pytest.raises(ConfigError, match="code in the hub repository org/model: .*model.revision"):
        parse_config(arm_text(code + "}").replace("source: /models/m", hub))
    config = parse_config(arm_text(code + "}").replace("source: /models/m", pinned))
    kwargs = build_llm_config(config.arm("no-spec"), config.model).engine_kwargs
    assert [kwargs[k] for k in ("revision", "code_revision", "tokenizer_revision")] == [COMMIT] * 3
    # Without code loading a hub repository's weights need no pin; a local directory is the
    # operator's own either way.
    assert parse_config(BASE.replace("source: /models/m", hub)).model.revision is None
    assert parse_config(arm_text(code + "}")).model.source == "/models/m"

    drafter = "speculative: {method: eagle3, model: org/drafter, num_speculative_tokens: 3%s}, "
    opted_in = code + ", drafter: true}"
    with pytest.raises(ConfigError, match="drafter's hub repository org/drafter: .*speculative"):
        parse_config(arm_text(drafter % "" + opted_in).replace("source: /models/m", pinned))
    config = parse_config(arm_text(drafter % f", revision: '{COMMIT}'" + opted_in))
    spec = build_llm_config(config.arm("no-spec"), config.model).engine_kwargs
    assert spec["speculative_config"]["revision"] == COMMIT
    assert spec["speculative_config"]["code_revision"] == COMMIT
    # A drafter without a pin leaves vLLM's default (no `revision` key for it).
    unpinned = parse_config(arm_text(drafter.removesuffix(", ") % ""))
    spec = build_llm_config(unpinned.arm("no-spec"), unpinned.model).engine_kwargs
    assert "revision" not in spec["speculative_config"]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("model: {name: m, source: org/m, revision: main}", "should match pattern"),
        (f"model: {{name: m, source: /models/m, revision: '{COMMIT}'}}", "pins a hub repository"),
        (f"model: {{name: m, source: 'embedded://x', revision: '{COMMIT}'}}", "pins a hub"),
    ],
)
def test_a_pin_is_a_commit_of_a_hub_repository(text, error):
    with pytest.raises(ConfigError, match=error):
        parse_config(BASE.replace("model: {name: m, source: /models/m, accelerator: cpu}", text))


@pytest.mark.parametrize("key", ["revision", "code_revision", "tokenizer_revision"])
def test_the_engines_revisions_come_from_the_models_pin_only(key):
    with pytest.raises(ConfigError, match=f"`{key}` is set by `model.revision`"):
        parse_config(arm_text(f"engine: {{{key}: main}}"))


def test_an_arms_builder_refuses_unpinned_code_in_a_hand_written_serve_config():
    from specserve.config.serve_config import ARM_ARG, MODEL_ARG
    from specserve.engine.arm import build_app

    args = {
        MODEL_ARG: {"name": "m", "source": "org/model"},
        ARM_ARG: {
            "name": "a",
            "engine": {"trust_remote_code": True},
            "allow_code_loading": {"engine": ["trust_remote_code"]},
        },
    }
    with pytest.raises(ValueError, match="pin the commit"):
        build_app(args)


def test_the_engine_settings_the_projects_configs_use_are_allowed():
    text = arm_text(
        "engine: {dtype: bfloat16, enforce_eager: true, max_num_seqs: 32, kv_cache_dtype: fp8,"
        " tensor_parallel_size: 4, gpu_memory_utilization: 0.9, enable_prefix_caching: false,"
        " compilation_config: {cudagraph_mode: FULL_AND_PIECEWISE, pass_config: {x: true}}}"
    )
    assert parse_config(text).arm("no-spec").engine["max_num_seqs"] == 32
    assert parse_config(arm_text("engine: {compilation_config: 3}"))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("LD_PRELOAD", "`LD_PRELOAD` loads a shared library into every engine process"),
        ("LD_LIBRARY_PATH", "`LD_LIBRARY_PATH` decides which shared libraries"),
        ("PYTHONPATH", "`PYTHONPATH` decides which Python modules"),
        ("PYTHONSTARTUP", "`PYTHONSTARTUP` names a Python file"),
        ("PYTHONHOME", "`PYTHONHOME` decides which Python modules"),
        ("PYTHONUSERBASE", "`PYTHONUSERBASE` adds a site-packages directory"),
        ("VLLM_PLUGINS", "`VLLM_PLUGINS` chooses the vLLM plugins"),
        ("VLLM_ALLOW_INSECURE_SERIALIZATION", "`VLLM_ALLOW_INSECURE_SERIALIZATION` lets the"),
        ("HF_TOKEN", "`HF_TOKEN` a secret"),
        ("VLLM_NCCL_SO_PATH", "`VLLM_NCCL_SO_PATH` names a file, directory, library or secret"),
        ("NCCL_NET_PLUGIN", "`NCCL_NET_PLUGIN` names a file, directory, library or secret"),
        (
            "CUDA_INJECTION64_PATH",
            "`CUDA_INJECTION64_PATH` names a file, directory, library or secret",
        ),
        ("OMP_TOOL_LIBRARIES", "`OMP_TOOL_LIBRARIES` names a file, directory, library or secret"),
        ("VLLM_CACHE_ROOT", "`VLLM_CACHE_ROOT` names a file, directory, library or secret"),
        ("RAY_ADDRESS", "`RAY_ADDRESS` is not on the environment allow-list (OMP_*, KMP_*"),
        ("VLLM_MAX_N_SEQUENCES", "`VLLM_MAX_N_SEQUENCES` is not on the environment allow-list "),
        (
            "VLLM_MAX_COMPLETION_PROMPTS",
            "`VLLM_MAX_COMPLETION_PROMPTS` is not on the environment allow-list (vLLM's other "
            "variables may raise its own caps)",
        ),
    ],
)
def test_environment_variables_that_load_code_need_the_operators_opt_in(name, message):
    with pytest.raises(ConfigError) as info:
        parse_config(arm_text(f"env: {{{name}: x}}"))
    assert f"`arms.0.env`: {message}" in str(info.value)
    assert "name it in `allow_code_loading.env`" in str(info.value)
    opted_in = parse_config(arm_text(f"env: {{{name}: x}}, allow_code_loading: {{env: [{name}]}}"))
    assert opted_in.arm("no-spec").env == {name: "x"}


def test_tuning_variables_are_allowed_and_odd_names_refused():
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_USE_FLASHINFER_MOE_FP4": "1",
        "OMP_NUM_THREADS": "2",
        "KMP_BLOCKTIME": "1",
        "MKL_NUM_THREADS": "2",
        "NCCL_DEBUG": "INFO",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    flow = ", ".join(f"{k}: '{v}'" for k, v in env.items())
    assert parse_config(arm_text(f"env: {{{flow}}}")).arm("no-spec").env == env
    with pytest.raises(ConfigError, match="`arms.0.env`: `A=B` is not an environment variable"):
        parse_config(arm_text("env: {'A=B': x}"))


@pytest.mark.parametrize(
    "model",
    ["package://../../etc", "package:///etc", "package://", "package://a/b", "package://.."],
)
def test_a_packaged_drafter_is_named_by_its_directory_only(model):
    text = BASE.replace(
        "{method: ngram, num_speculative_tokens: 3}",
        f"{{method: eagle3, model: '{model}', num_speculative_tokens: 3}}",
    )
    with pytest.raises(ConfigError, match="`arms.1.speculative.eagle3.model`: .* no path"):
        parse_config(text)


def test_a_stopped_arm_replica_finishes_requests_as_long_as_any_may_run():
    # Ray Serve's default (20 s) cut streams when a replica was stopped by a redeploy or moved
    # off a drained node.
    config = load_config(DEFAULT_CONFIG_PATH).config
    # A hub id: the embedded model's directory needs no preparing for the LLM config to build.
    model = config.model.model_copy(update={"source": "org/model"})
    for arm in config.arms:
        options = build_llm_config(arm, model).deployment_config
        assert options["graceful_shutdown_timeout_s"] >= config.limits.request_timeout_s
