"""`specserve config apply | history | rollback --local` (config/local_store.py): the file a local
`specserve serve` runs from gets revisions and a history beside it, as a release's ConfigMap
does on Kubernetes; a bad file changes nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from specserve.cli import main as cli
from specserve.config.local_store import LocalStore
from specserve.config.schema import parse_config, revision_of
from specserve.config.store import StoreError
from tests.conftest import render_config

T0 = datetime(2026, 11, 26, 9, 0, tzinfo=UTC)


def texts() -> tuple[str, str, str]:
    return (
        render_config(),
        render_config(no_spec_weight=1, ngram_weight=3),
        render_config(no_spec_weight=2, ngram_weight=2),
    )


def test_apply_replaces_the_file_and_records_both_revisions_then_rollback_goes_back(tmp_path):
    first, second, third = texts()
    live = tmp_path / "config.yaml"
    live.write_text(first)
    local = LocalStore(live)
    outcome = local.apply(second, parse_config(second), now=T0)
    assert outcome.changed and live.read_text() == second
    assert outcome.old_revision == revision_of(first.encode())
    assert {r.revision for r in local.records()} == {outcome.old_revision, outcome.new_revision}
    local.apply(third, parse_config(third), now=T0 + timedelta(minutes=1))
    back = local.rollback(now=T0 + timedelta(minutes=2))
    assert live.read_text() == second and back.new_revision == revision_of(second.encode())
    # After a rollback, "the one before" is the revision rolled back from.
    local.rollback(now=T0 + timedelta(minutes=3))
    assert live.read_text() == third
    to_first = local.rollback(to=revision_of(first.encode())[:6], now=T0 + timedelta(minutes=4))
    assert live.read_text() == first and to_first.old_revision == revision_of(third.encode())
    table = local.history()
    assert table[0].split()[:2] == ["REVISION", "APPLIED"]
    assert table[1].startswith(revision_of(first.encode())) and "live" in table[1]
    assert len(table) == 4


def test_applying_the_live_revision_changes_nothing_and_history_is_pruned(tmp_path):
    first, second, third = texts()
    live = tmp_path / "config.yaml"
    live.write_text(first)
    local = LocalStore(live)
    assert not local.apply(first, parse_config(first), now=T0).changed
    assert local.records() == []
    local.apply(second, parse_config(second), now=T0)
    pruned = local.apply(third, parse_config(third), keep=2, now=T0 + timedelta(minutes=1)).pruned
    assert pruned == (revision_of(first.encode()),)
    assert {r.revision for r in local.records()} == {
        revision_of(second.encode()),
        revision_of(third.encode()),
    }
    with pytest.raises(StoreError, match="no revision 'ffff'"):
        local.rollback(to="ffff")


def test_the_cli_validates_before_it_touches_the_live_file(tmp_path, capsys):
    first, second, _ = texts()
    live = tmp_path / "config.yaml"
    live.write_text(first)
    bad = tmp_path / "bad.yaml"
    bad.write_text(second.replace("weight: 1", "weight: -1", 1))
    assert cli(["config", "apply", str(bad), "--local", str(live)]) == 2
    assert live.read_text() == first and not (tmp_path / "config.yaml.history").exists()
    good = tmp_path / "good.yaml"
    good.write_text(second)
    assert cli(["config", "apply", str(good), "--local", str(live)]) == 0
    out = capsys.readouterr().out
    assert f"revision {revision_of(first.encode())} -> {revision_of(second.encode())}" in out
    assert live.read_text() == second
    assert cli(["config", "rollback", "--local", str(live)]) == 0
    assert live.read_text() == first
    assert cli(["config", "history", "--local", str(live)]) == 0
    assert "live" in capsys.readouterr().out
    assert cli(["config", "history", "--local", str(tmp_path / "missing.yaml")]) == 2
    assert "no config file there" in capsys.readouterr().err


def test_an_apply_says_which_engines_the_running_serve_redeploys_and_a_weight_touches_none(
    tmp_path, capsys
):
    first = render_config()
    live = tmp_path / "config.yaml"
    live.write_text(first)
    local = LocalStore(live)
    reweighted = render_config(ngram_weight=5)
    assert not local.apply(reweighted, parse_config(reweighted), now=T0).engines
    redrafted = render_config(ngram_weight=5, k=5)
    outcome = local.apply(redrafted, parse_config(redrafted), now=T0 + timedelta(minutes=1))
    assert (outcome.engines.redeployed, outcome.engines.rescaled) == (("ngram",), ())
    assert local.notes(outcome)[-1] == "arms: Ray Serve redeploys ngram"
    rescaled = redrafted.replace("max_ongoing_requests: 4", "max_ongoing_requests: 6", 1)
    assert rescaled != redrafted
    outcome = local.apply(rescaled, parse_config(rescaled), now=T0 + timedelta(minutes=2))
    assert (outcome.engines.redeployed, outcome.engines.rescaled) == ((), ("ngram",))
    assert local.notes(outcome)[-1] == "arms: Ray Serve rescales ngram in place"


def test_a_check_refuses_a_config_before_anything_is_written(tmp_path):
    first, second, _ = texts()
    live = tmp_path / "config.yaml"
    live.write_text(first)

    def refuse(config):
        raise StoreError("vLLM would not start this")

    with pytest.raises(StoreError, match="vLLM would not"):
        LocalStore(live, check=refuse).apply(second, parse_config(second), now=T0)
    assert live.read_text() == first and not (tmp_path / "config.yaml.history").exists()


def test_without_a_configured_file_the_packaged_default_is_copied_once_and_never_written(
    tmp_path, monkeypatch, capsys
):
    """The README's way: `specserve serve` with nothing configured, then `config apply --local`:
    the revision goes to the cache dir's copy, the installed package stays as shipped."""
    from specserve import cli as cli_module
    from specserve.config.local_store import local_config_path
    from specserve.config.settings import DEFAULT_CONFIG_PATH, Settings, get_settings

    shipped = DEFAULT_CONFIG_PATH.read_bytes()
    cache = tmp_path / "cache"
    copy = local_config_path(Settings(config=DEFAULT_CONFIG_PATH, cache_dir=cache))
    assert copy == cache / "config.yaml" and copy.read_bytes() == shipped
    configured = tmp_path / "mine.yaml"
    assert local_config_path(Settings(config=configured, cache_dir=cache)) == configured
    # A cache dir that cannot be written (a container's, read-only): the default, as it is.
    (tmp_path / "a-file").write_text("")
    unwritable = Settings(config=DEFAULT_CONFIG_PATH, cache_dir=tmp_path / "a-file" / "cache")
    assert local_config_path(unwritable) == DEFAULT_CONFIG_PATH

    monkeypatch.delenv("SPECSERVE_CONFIG", raising=False)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(cache))
    monkeypatch.setattr(cli_module, "check_engine_settings", lambda *a, **k: None)
    get_settings.cache_clear()
    try:
        _, second, _ = texts()
        new = tmp_path / "new.yaml"
        new.write_text(second)
        assert cli(["config", "apply", str(new), "--local"]) == 0
        assert f"{copy}:" in capsys.readouterr().out
        assert copy.read_text() == second  # the copy is kept, with what was applied
        assert local_config_path(get_settings()).read_text() == second
        assert cli(["config", "rollback", "--local"]) == 0
        assert copy.read_bytes() == shipped
    finally:
        get_settings.cache_clear()
    assert DEFAULT_CONFIG_PATH.read_bytes() == shipped
    assert not DEFAULT_CONFIG_PATH.with_name(DEFAULT_CONFIG_PATH.name + ".history").exists()


@pytest.mark.parametrize("configured", [False, True])
def test_serve_says_copy_only_when_it_serves_the_cache_dirs_copy(tmp_path, monkeypatch, configured):
    """`specserve serve`'s banner notes the copy only where nothing was configured or given."""
    from specserve.cli import serving_config
    from specserve.config.settings import get_settings

    cache, mine = tmp_path / "cache", tmp_path / "mine.yaml"
    mine.write_text(render_config())
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(cache))
    if configured:
        monkeypatch.setenv("SPECSERVE_CONFIG", str(mine))
    else:
        monkeypatch.delenv("SPECSERVE_CONFIG", raising=False)
    get_settings.cache_clear()
    try:
        expected = (mine, False) if configured else (cache / "config.yaml", True)
        assert serving_config(None) == expected
        assert serving_config(mine) == (mine, False)
    finally:
        get_settings.cache_clear()
