"""A Ray cluster whose HTTP proxies run without specserve's dispatch (started without the
callback hook): the router application says what is missing, and `specserve serve` stops
waiting for it instead of timing out. A real Ray Serve with the real router application."""

import time

import httpx
import pytest
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

from specserve.config.serve_config import PROXY_HOOK_ENV, router_application
from specserve.config.settings import Settings
from specserve.deploy import DeployError, Platform
from tests.conftest import MODEL, free_port, own_ray_cluster, render_config

pytestmark = pytest.mark.own_cluster


@pytest.fixture
def router_without_dispatch(tmp_path, monkeypatch):
    monkeypatch.delenv(PROXY_HOOK_ENV, raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(render_config())
    port = free_port()
    with own_ray_cluster(num_cpus=2, include_dashboard=False):
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            document = {"applications": [router_application(config_path=str(config))]}
            _get_global_client().deploy_apps(ServeDeploySchema.model_validate(document))
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while not _healthy(base):  # the replica imports vLLM's request models as it starts
                assert time.monotonic() < deadline, "the router application did not start"
                time.sleep(0.5)
            yield config, port, base
        finally:
            serve.shutdown()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def test_ready_and_inference_say_how_to_install_the_dispatch(router_without_dispatch):
    config, port, base = router_without_dispatch
    ready = httpx.get(f"{base}/ready", timeout=30)
    assert ready.status_code == 503
    assert ready.json()["dispatch"] is False and PROXY_HOOK_ENV in ready.json()["error"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["code"] == "dispatch_not_installed" and PROXY_HOOK_ENV in error["message"]

    platform = Platform(Settings(config=config, port=port))
    started = time.monotonic()
    with pytest.raises(DeployError, match=PROXY_HOOK_ENV):
        platform.wait_until_running(timeout_s=300)
    assert time.monotonic() - started < 30  # at once, not after the timeout
