"""One rendered release run as a cluster for the tests of this directory (harness.py).

It needs root (network and mount namespaces), nftables, curl and wget, and the prepared
embedded model; CI has all of them. It starts its own Ray processes in their own namespaces, so it
may run beside the integration tests' platform; they share the machine's two cores.
"""

from __future__ import annotations

import os
import shutil

import pytest

from specserve.config.settings import get_settings
from tests.cluster.harness import RenderedCluster
from tests.conftest import unavailable


def _missing() -> list[str]:
    missing = [
        tool
        for tool in ("ip", "nft", "unshare", "setpriv", "curl", "wget")
        if not shutil.which(tool)
    ]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    missing = _missing()
    if missing:
        unavailable(f"the cluster harness needs {missing}")
    models = get_settings().cache_dir
    running = RenderedCluster(tmp_path_factory.mktemp("pods"), models)
    try:
        running.up()
        yield running
    except BaseException:
        print(running.describe())
        raise
    finally:
        running.close()
