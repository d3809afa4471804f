"""Engine settings are checked with vLLM's own argument parser before anything is deployed."""

import re
import shutil
from pathlib import Path

import pytest

from specserve import models
from specserve.config.checks import _parser, check_engine_settings, engine_problems
from specserve.config.policy import ENGINE_ALLOWED, ENGINE_REFUSED
from specserve.config.schema import ConfigError, RouterConfig, load_config
from specserve.metrics import RELOAD_INVALID
from specserve.watch import ConfigWatcher

CHART = Path(__file__).parents[2] / "helm" / "specserve"


def config_with(
    engine: dict, speculative: dict | None = None, allow: list[str] | None = None
) -> RouterConfig:
    arm = {"name": "a", "weight": 1, "engine": engine}
    if speculative:
        arm["speculative"] = speculative
    if allow:
        arm["allow_code_loading"] = {"engine": allow}
    return RouterConfig.model_validate({"model": {"name": "m", "source": "s"}, "arms": [arm]})


def test_settings_vllm_accepts_pass():
    engine = {
        "dtype": "bfloat16",
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_num_seqs": 16,
        "kv_cache_dtype": "fp8",
        "tensor_parallel_size": 4,
        "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
    }
    assert engine_problems(config_with(engine)) == []


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (
            {"max_num_seq": 16},
            "`max_num_seq` is not a vLLM engine argument (did you mean `max_num_seqs`?)",
        ),
        ({"dtype": "bf17"}, "`dtype`: argument --dtype: invalid choice: 'bf17'"),
        ({"max_num_seqs": "many"}, "`max_num_seqs`: argument --max-num-seqs: invalid int value"),
        ({"kv_cache_dtype": "int3"}, "`kv_cache_dtype`: argument --kv-cache-dtype: invalid choice"),
    ],
)
def test_settings_vllm_rejects_are_named(engine, expected):
    # A setting outside the allow-list, once the operator opts in to it, still meets vLLM's parser.
    config = config_with(engine, allow=[key for key in engine if key not in ENGINE_ALLOWED])
    problems = engine_problems(config)
    assert len(problems) == 1 and problems[0].startswith("arm 'a': engine: " + expected), problems
    with pytest.raises(ConfigError, match="^f.yaml: arm 'a'"):
        check_engine_settings(config, source="f.yaml")


def test_the_engine_allow_lists_name_vllm_engine_arguments():
    """A typo in the allow-list would allow nothing; a refused key vLLM renamed would no longer
    be refused by its reason."""
    from vllm.config import CompilationConfig

    from specserve.config.policy import COMPILATION_ALLOWED

    assert ENGINE_ALLOWED - set(_parser().actions) == set()
    assert set(ENGINE_REFUSED) - set(_parser().actions) == set()
    assert COMPILATION_ALLOWED - set(CompilationConfig.__dataclass_fields__) == set()


def test_packaged_drafters_outside_the_drafters_directory_are_refused(tmp_path, monkeypatch):
    """Checked with the config, not first when the arm's engine starts."""
    drafters = tmp_path / "drafters"
    (drafters / "good").mkdir(parents=True)
    (drafters / "good" / "config.json").write_text("{}")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "config.json").write_text("{}")
    (drafters / "out").symlink_to(tmp_path / "secret")
    monkeypatch.setattr(models, "PACKAGED_DRAFTERS_DIR", drafters)

    def spec(model: str) -> dict:
        return {"method": "eagle3", "model": model, "num_speculative_tokens": 3}

    assert engine_problems(config_with({}, spec("package://good"))) == []
    (problem,) = engine_problems(config_with({}, spec("package://out")))
    assert problem == f"arm 'a': packaged drafter 'package://out' lies outside {drafters}"
    with pytest.raises(ConfigError, match="lies outside"):
        check_engine_settings(config_with({}, spec("package://out")), source="f.yaml")
    (problem,) = engine_problems(config_with({}, spec("package://nope")))
    assert "no packaged drafter 'package://nope'; shipped: ['good']" in problem
    # What the schema lets through is refused where the engine resolves it, too.
    for escape in ("../secret", str(tmp_path / "secret"), "", "."):
        with pytest.raises(models.ModelError, match="lies outside"):
            models.resolve_drafter_source("package://" + escape)


def test_a_missing_drafter_directory_matters_only_where_the_engines_run(tmp_path):
    missing = {"method": "eagle3", "model": str(tmp_path / "nope"), "num_speculative_tokens": 3}
    config = config_with({}, missing)
    assert engine_problems(config) == []  # e.g. a path inside the cluster's pods
    assert engine_problems(config, engines_run_here=True) == [
        f"arm 'a': drafter directory {tmp_path / 'nope'} does not exist"
    ]
    (tmp_path / "nope").mkdir()
    hub_and_package = [
        {"method": "eagle3", "model": "org/drafter", "num_speculative_tokens": 3},
        {"method": "eagle3", "model": "package://eagle3", "num_speculative_tokens": 3},
    ]
    for spec in [missing, *hub_and_package]:
        assert engine_problems(config_with({}, spec), engines_run_here=True) == []


def test_drafter_weights_must_have_the_tensors_of_the_arms_drafter(tmp_path):
    """Weights the running engines could not load are refused before the config applies
    (where both checkpoints can be read here); the engines would log and ignore them."""
    eagle3 = {"method": "eagle3", "model": "package://eagle3", "num_speculative_tokens": 1}
    fitting = tmp_path / "adapted"
    shutil.copytree(models.resolve_drafter_source("package://eagle3"), fitting)

    def problems(weights: str, *, here: bool = True) -> list[str]:
        arm = {"name": "a", "weight": 1, "speculative": eagle3, "drafter_weights": weights}
        config = RouterConfig.model_validate({"model": {"name": "m", "source": "s"}, "arms": [arm]})
        return engine_problems(config, engines_run_here=here)

    assert problems("package://eagle3") == [] and problems(str(fitting)) == []
    (misfit,) = problems("package://eagle3.1")  # EAGLE-3.1's norms: other tensors
    assert misfit.startswith("arm 'a': drafter_weights: ") and "adds fc_norm.0.weight" in misfit
    assert problems(str(tmp_path / "nope")) == [
        f"arm 'a': drafter_weights: directory {tmp_path / 'nope'} does not exist"
    ]
    assert problems(str(tmp_path / "nope"), here=False) == []  # a path in the cluster's pods
    for wrong, says in (
        ({"method": "none"}, "replaces an EAGLE drafter's weights"),
        (eagle3, "an absolute directory or `package://NAME`"),
    ):
        arm = {"name": "a", "weight": 1, "speculative": wrong, "drafter_weights": "relative/dir"}
        with pytest.raises(ValueError, match=re.escape(says)):
            RouterConfig.model_validate({"model": {"name": "m", "source": "s"}, "arms": [arm]})


def test_the_watcher_keeps_the_last_good_config_over_a_bad_engine_setting(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model: {name: m, source: s}\narms:\n  - {name: a, weight: 1}\n")
    results = []
    watcher = ConfigWatcher(path, load_config(path), lambda _: None, results.append)
    path.write_text(
        "model: {name: m, source: s}\narms:\n  - {name: a, weight: 1, engine: {dtype: bf17}}\n"
    )
    assert watcher.check() is None
    assert results == [RELOAD_INVALID]
    assert "invalid choice: 'bf17'" in watcher.last_error
    assert watcher.current.config.arms[0].engine == {}
