"""Ray Serve's replica log, kept through vLLM's logging set-up.

vLLM applies its logging configuration with `logging.config.dictConfig` when it creates an
engine (`vllm.logger.configure_logging`), and dictConfig first closes every handler of the
process. A replica's Serve logger writes through a `MemoryHandler` in front of the replica's log
file, and a closed MemoryHandler drops its target. From then on:

- nothing more reaches the replica's log file, and every record it is given (an access log line
  per request) stays in its buffer for good: the buffer is only emptied into a target;
- Ray Serve's `is_allocated` call reads the log file's name from that target and raises. Serve's
  controller makes the call again whenever it recovers (a head pod restarted under GCS fault
  tolerance, a crashed controller), and then stops every engine replica it finds and starts new
  ones: the engines load again although they were running fine.

`keep_serve_log_targets` puts the targets back once vLLM has configured its logging. The file
handler behind reopens its file on the next record.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
from collections.abc import Iterator

# Ray Serve's component logger (ray.serve._private.constants.SERVE_LOGGER_NAME).
SERVE_LOGGER = "ray.serve"


@contextlib.contextmanager
def keep_serve_log_targets() -> Iterator[None]:
    """Give each buffering handler of Ray Serve's logger back the target it had on entry."""
    buffers = [
        (handler, handler.target)
        for handler in logging.getLogger(SERVE_LOGGER).handlers
        if isinstance(handler, logging.handlers.MemoryHandler) and handler.target is not None
    ]
    try:
        yield
    finally:
        for handler, target in buffers:
            if handler.target is None:
                handler.setTarget(target)
