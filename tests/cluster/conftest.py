"""One rendered release run as a cluster for the tests of this directory (harness.py).

It needs root (network and mount namespaces), nftables, curl and wget, Debian's redis-server
(GCS fault tolerance's store) and the prepared embedded model; CI has all of them. It starts its
own Ray processes in their own namespaces, so it may run beside the integration tests'
platform; they share the machine's two cores.
"""

from __future__ import annotations

import os
import shutil

import pytest

from specserve.config.settings import get_settings
from tests.cluster.harness import RenderedCluster
from tests.conftest import unavailable


def missing() -> list[str]:
    found = [
        tool
        for tool in ("ip", "nft", "unshare", "nsenter", "setpriv", "curl", "wget", "redis-server")
        if not shutil.which(tool)
    ]
    if os.geteuid() != 0:
        found.append("root")
    return found


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    needed = missing()
    if needed:
        unavailable(f"the cluster harness needs {needed}")
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
