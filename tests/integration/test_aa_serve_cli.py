"""`specserve serve` (what `make serve` runs): prints where everything is, answers, and Ctrl-C
stops everything it started. Runs before the shared platform starts (file order)."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import MODEL, free_port, render_config

pytestmark = pytest.mark.slow


def test_serve_prints_banner_answers_and_stops_on_ctrl_c(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(render_config())
    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, SPECSERVE_PORT=str(port), SPECSERVE_METRICS_PORT=str(metrics_port))
    log = (tmp_path / "serve.log").open("w+")
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "--config", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        while "Ctrl-C stops everything" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() - started < 600, "not up in 10 minutes"
            time.sleep(1)
        up_after = time.monotonic() - started
        banner = (tmp_path / "serve.log").read_text()
        assert f"API:     http://127.0.0.1:{port}/v1" in banner
        assert f"metrics: http://127.0.0.1:{metrics_port}/metrics" in banner
        assert f"config:  {config}" in banner and "(revision " in banner
        assert "arm no-spec: weight 1" in banner and "arm ngram: weight 1" in banner
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
            timeout=120,
        )
        assert answer.status_code == 200
        print(f"up after {up_after:.0f} s, first answer after {time.monotonic() - started:.0f} s")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
