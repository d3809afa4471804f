"""Ray Serve's replica log through vLLM's logging set-up (engine/serve_log.py), with the real
vLLM configuring its logging as it does when an engine starts."""

from __future__ import annotations

import logging
import logging.handlers

import pytest

from specserve.engine.serve_log import SERVE_LOGGER, keep_serve_log_targets


@pytest.fixture
def serve_log(tmp_path):
    """A replica's Serve logger as Ray Serve sets it up: a MemoryHandler in front of its file."""
    path = tmp_path / "replica.log"
    target = logging.handlers.RotatingFileHandler(path)
    buffer = logging.handlers.MemoryHandler(capacity=1, target=target)
    logger = logging.getLogger(SERVE_LOGGER)
    logger.addHandler(buffer)
    yield logger, buffer, path
    logger.removeHandler(buffer)
    target.close()


def configure_vllm_logging():
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())


def test_vllm_logging_set_up_drops_the_target_of_serves_replica_log(serve_log):
    logger, buffer, path = serve_log
    configure_vllm_logging()
    assert buffer.target is None  # what Serve's is_allocated then fails on
    logger.warning("after the engine started")
    assert buffer.buffer, "the record is kept in memory"
    assert "after the engine started" not in path.read_text()


def test_the_replica_log_keeps_its_file_through_vllms_set_up(serve_log):
    logger, buffer, path = serve_log
    target = buffer.target
    with keep_serve_log_targets():
        configure_vllm_logging()
    assert buffer.target is target
    logger.warning("after the engine started")
    assert not buffer.buffer
    assert "after the engine started" in path.read_text()
