"""The cluster harness weighs each pod's CPU as kubelet does (cgroup v1 `cpu.shares` from the
container's CPU request: milliCPU x 1024 / 1000, at least 2)."""

import pytest

from tests.cluster.kubelet import cpu_shares


@pytest.mark.parametrize(
    ("request_", "shares"),
    [("2", 2048), ("500m", 512), ("0.25", 256), ("1m", 2), ("64", 65536)],
)
def test_a_cpu_request_becomes_kubelets_cpu_shares(request_, shares):
    assert cpu_shares(request_) == shares
