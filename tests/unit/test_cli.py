from pathlib import Path

import pytest

import specserve
from specserve.cli import main
from specserve.config.settings import get_settings

A = """\
model: {name: m, source: s}
arms:
  - {name: a, weight: 1}
  - name: b
    weight: 1
    speculative: {method: ngram, num_speculative_tokens: 3}
"""


def test_validate_reports_revision_and_arms(tmp_path, capsys):
    path = tmp_path / "a.yaml"
    path.write_text(A)
    assert main(["config", "validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid, revision" in out and "a=1, b=1" in out


def test_validate_rejects_with_field_and_exit_code(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(A.replace("weight: 1}", "weight: x}"))
    assert main(["config", "validate", str(path)]) == 2
    assert "arms.0.weight" in capsys.readouterr().err


def test_diff_separates_live_changes_from_redeploys(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(A)
    b.write_text(
        A.replace("{name: a, weight: 1}", "{name: a, weight: 4}").replace(
            "num_speculative_tokens: 3", "num_speculative_tokens: 5"
        )
        + "  - {name: c, weight: 1}\n"
    )
    assert main(["config", "diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "~ arm a weight 1 -> 4 (live)" in out
    assert "~ arm b speculative changed (redeploys this arm)" in out
    assert "+ arm c weight 1 (new engine)" in out
    b.write_text(A.replace("{name: a, weight: 1}", "{name: a, weight: 1, replicas: 2}"))
    assert main(["config", "diff", str(a), str(b)]) == 0
    assert "~ arm a replicas changed (applied to the running engines)" in capsys.readouterr().out
    assert main(["config", "diff", str(a), str(a)]) == 0
    assert "no changes" in capsys.readouterr().out


def test_serve_config_prints_the_document_serve_deploy_takes(tmp_path, capsys):
    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = tmp_path / "a.yaml"
    path.write_text(A)
    assert main(["config", "serve-config", str(path), "--config-path", "/cfg/c.yaml"]) == 0
    document = yaml.safe_load(capsys.readouterr().out)
    ServeDeploySchema.model_validate(document)
    apps = {app["name"]: app for app in document["applications"]}
    assert list(apps) == ["specserve", "arm-a", "arm-b"]
    assert apps["specserve"]["args"]["config_path"] == "/cfg/c.yaml"
    assert apps["arm-b"]["args"]["arm"] == {
        "name": "b",
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
    }
    assert main(["config", "serve-config", str(tmp_path / "missing.yaml")]) == 2


def test_building_the_command_line_reads_no_settings():
    """`serve --config` sets SPECSERVE_CONFIG before the settings are first read (they are
    cached): a parser default that read them earlier made `--config` silently ignored."""
    get_settings.cache_clear()
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert get_settings.cache_info().currsize == 0


def test_serve_refuses_a_non_loopback_address_without_api_keys(monkeypatch, capsys):
    from specserve.config.settings import get_settings

    monkeypatch.setenv("SPECSERVE_HOST", "0.0.0.0")
    get_settings.cache_clear()
    try:
        assert main(["serve"]) == 2
        err = capsys.readouterr().err
        assert "without API keys" in err and "SPECSERVE_API_KEYS_FILE" in err
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize(
    "host, env, allowed",
    [
        ("127.0.0.1", {}, True),
        ("::1", {}, True),
        ("0.0.0.0", {"SPECSERVE_ALLOW_UNAUTHENTICATED": "1"}, True),
        ("0.0.0.0", {"SPECSERVE_API_KEYS_FILE": "/etc/keys"}, True),
        ("10.1.2.3", {}, False),
    ],
)
def test_which_addresses_serve_without_keys(monkeypatch, host, env, allowed):
    from specserve.config.settings import Settings
    from specserve.deploy import DeployError, check_exposure

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings(host=host)
    if allowed:
        check_exposure(settings)
    else:
        with pytest.raises(DeployError):
            check_exposure(settings)


@pytest.mark.parametrize(
    ("mode", "refused"), [(None, False), ("token", False), ("TOKEN", False), ("disabled", True)]
)
def test_a_local_ray_cluster_is_refused_with_rays_token_authentication_turned_off(mode, refused):
    from specserve.deploy import RAY_AUTH_MODE_ENV, DeployError, refuse_ray_without_token

    environ = {} if mode is None else {RAY_AUTH_MODE_ENV: mode}
    if refused:
        with pytest.raises(DeployError, match=f"{RAY_AUTH_MODE_ENV}=disabled"):
            refuse_ray_without_token(environ)
    else:
        refuse_ray_without_token(environ)


def test_a_started_local_cluster_must_have_tokens_on_and_its_token_file_is_made_private(tmp_path):
    from specserve.deploy import RAY_AUTH_MODE_ENV, DeployError, check_ray_token

    token = tmp_path / "auth_token"
    token.write_text("t" * 64)
    token.chmod(0o644)  # as Ray writes it under the usual umask
    with pytest.raises(DeployError, match="without token authentication"):
        check_ray_token({}, token)
    check_ray_token({RAY_AUTH_MODE_ENV: "token"}, token)
    assert token.stat().st_mode & 0o777 == 0o600
    check_ray_token({RAY_AUTH_MODE_ENV: "token"}, tmp_path / "none")  # no file: nothing to do


@pytest.fixture
def held_port():
    """A loopback port another server listens on (as a running `specserve serve` would)."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture
def platform_config(tmp_path, fresh_serve_process):
    """A config to serve, in a process that looks fresh to `specserve serve`."""
    from tests.conftest import render_config

    config = tmp_path / "config.yaml"
    config.write_text(render_config())
    return config


def test_a_second_serve_says_at_once_that_the_port_is_taken(
    platform_config, held_port, monkeypatch, capsys
):
    """Another `specserve serve` holds the HTTP port: refused before Ray starts, not after
    Ray's start-up timeout. (A unit test: starting Ray would fail it, tests/tiers.py.)"""
    import os

    import psutil

    from tests.conftest import free_port

    monkeypatch.setenv("SPECSERVE_CONFIG", str(platform_config))
    monkeypatch.setenv("SPECSERVE_PORT", str(held_port))
    monkeypatch.setenv("SPECSERVE_METRICS_PORT", str(free_port()))
    get_settings.cache_clear()
    try:
        assert main(["serve", "--config", str(platform_config)]) == 2
    finally:
        get_settings.cache_clear()
    err = capsys.readouterr().err
    assert "already runs here" in err and f"HTTP (SPECSERVE_PORT) port {held_port}" in err
    assert f"in use: by {psutil.Process().name()} (pid {os.getpid()})" in err  # who holds it
    assert "SPECSERVE_METRICS_PORT" in err and "ray stop" in err


def test_the_metrics_port_taken_on_any_address_is_refused(platform_config, held_port):
    from specserve.config.settings import Settings
    from specserve.deploy import DeployError, Platform
    from tests.conftest import free_port

    settings = Settings(config=platform_config, port=free_port(), metrics_port=held_port)
    with pytest.raises(DeployError, match=f"metrics .* port {held_port} on 0.0.0.0"):
        Platform(settings).preflight()
    Platform(settings.model_copy(update={"metrics_port": free_port()})).preflight()


def test_adapt_options_left_out_keep_the_library_defaults_and_given_ones_win(tmp_path):
    from dataclasses import replace

    from specserve.cli import build_parser
    from specserve.drafter.adapt import AdaptConfig
    from specserve.drafter_commands import adapt_config

    def config(*options):
        args = build_parser().parse_args(
            ["drafter", "adapt", "--captured", str(tmp_path), *options]
        )
        return adapt_config(args, "package://eagle3.1", "target")

    library = AdaptConfig(
        base="package://eagle3.1",
        captured=tmp_path,
        work_dir=get_settings().cache_dir / "adapt",
        out_dir=get_settings().cache_dir / "adapted",
        target_dir="target",
    )
    assert config() == library
    given = config("--lr", "5e-4", "--updates", "8", "--workers", "1", "--max-forgetting", "0.1")
    assert given == replace(
        library,
        workers=1,
        max_forgetting=0.1,
        train=replace(library.train, lr=5e-4, updates=8),
    )


SHIPPED = str(Path(specserve.__file__).parent / "drafters" / "eagle3.1")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["drafter", "eval", "x=/nonexistent"], "/nonexistent: no exported drafter there"),
        (["drafter", "eval", SHIPPED], "NAME=DIR expected"),
        (["drafter", "diagnose", "/nonexistent"], "NAME=DIR expected"),
        (["drafter", "diagnose", f"={SHIPPED}"], "NAME=DIR expected"),
    ],
)
def test_a_drafter_that_is_not_there_is_refused_before_anything_loads(argv, said, capsys):
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    assert said in capsys.readouterr().err


def test_a_loop_candidate_that_is_not_there_is_refused_and_the_live_config_kept(tmp_path, capsys):
    live = tmp_path / "config.yaml"
    live.write_text(A)
    argv = ["loop", "--local", str(live), "--incumbent", "b", "--prometheus", "http://x:9"]
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--work-dir", str(tmp_path / "work"), "--candidate", str(tmp_path / "no")])
    assert refused.value.code == 2
    assert "no exported drafter there" in capsys.readouterr().err
    assert live.read_text() == A and not (tmp_path / "work").exists()


def test_named_drafters_are_read_as_name_and_directory():
    from specserve.drafter_commands import named_drafter

    assert named_drafter(f"eagle3.1={SHIPPED}") == ("eagle3.1", SHIPPED)
