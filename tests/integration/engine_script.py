"""Running a script that starts an in-process vLLM engine in a process of its own: vLLM's
plugins (specserve's fixes) load once per process, with the environment the script sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_engine_script(tmp_path: Path, source: str, timeout: float = 280) -> Any:
    """Run `source` as a script; -> the JSON of its last line of output."""
    script = tmp_path / "engine_script.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
