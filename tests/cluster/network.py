"""The pod network, played with Linux network namespaces: what a CNI plugin gives each pod.

Every endpoint (a Ray pod, or a client standing for another namespace's pods: KubeRay's
operator, the Ingress controller, Prometheus, an outsider) gets a network namespace of its own,
a veth pair to one bridge and an address of its own in TEST_NET below. Endpoints reach each
other only through those addresses, as pods do on a cluster. The NetworkPolicy is enforced
inside each selected pod's namespace by nftables rules (netpol.py). Everything made here is
named with PREFIX and removed by `Network.close`, also after a failure.
"""

from __future__ import annotations

import contextlib
import ipaddress
import subprocess
from dataclasses import dataclass, field

PREFIX = "ssk"
BRIDGE = f"{PREFIX}br0"
# A private range the tests own; the bridge (the "node") takes the first address.
TEST_NET = ipaddress.ip_network("10.231.0.0/24")


def sh(*argv: str, check: bool = True, input: str | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


@dataclass
class Endpoint:
    """A network namespace with one address: a pod, or a client in another namespace."""

    name: str
    namespace: str  # the Kubernetes namespace it stands in
    labels: dict[str, str]
    ip: str
    netns: str = field(init=False)

    def __post_init__(self) -> None:
        self.netns = f"{PREFIX}-{self.name}"

    def run(
        self,
        *argv: str,
        timeout: float = 30,
        env: dict[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a command in this endpoint's network namespace."""
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            input=input,
        )


class Network:
    def __init__(self) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        self._links = 0  # veth pairs made, for their names
        self._hosts = TEST_NET.hosts()
        self.gateway = str(next(self._hosts))
        self.close()  # what an interrupted run left
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/{TEST_NET.prefixlen}", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")

    def add(self, name: str, namespace: str, labels: dict[str, str]) -> Endpoint:
        endpoint = Endpoint(name, namespace, labels, str(next(self._hosts)))
        self._links += 1
        host_side, ns = f"{PREFIX}v{self._links}", endpoint.netns
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_side, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", host_side, "master", BRIDGE, "up")
        in_ns = ("ip", "netns", "exec", ns)
        sh(*in_ns, "ip", "addr", "add", f"{endpoint.ip}/{TEST_NET.prefixlen}", "dev", "eth0")
        sh(*in_ns, "ip", "link", "set", "eth0", "up")
        sh(*in_ns, "ip", "link", "set", "lo", "up")
        sh(*in_ns, "ip", "route", "add", "default", "via", self.gateway)
        self.endpoints[name] = endpoint
        return endpoint

    def remove(self, name: str) -> None:
        """A deleted pod's sandbox: its namespace and veth pair go, its address is not reused."""
        endpoint = self.endpoints.pop(name)
        sh("ip", "netns", "delete", endpoint.netns, check=False)

    def close(self) -> None:
        """Remove every namespace and link this module makes (by PREFIX), whoever made them."""
        for ns in sh("ip", "netns", "list", check=False).split("\n"):
            name = ns.split(" ")[0]
            if name.startswith(f"{PREFIX}-"):
                sh("ip", "netns", "delete", name, check=False)
        # A namespace lives on while anything still holds it (a socket closing, a mount
        # namespace that copied its name): its veth pairs and the bridge are removed directly.
        for line in sh("ip", "-o", "link", "show", check=False).splitlines():
            name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
            if name.startswith(PREFIX):
                with contextlib.suppress(RuntimeError):
                    sh("ip", "link", "delete", name)


class ClusterDNS:
    """Cluster DNS, played by the hosts file every pod mounts at /etc/hosts: a Service's name
    -> the address of the pod behind it, changed in place (the pods' mounts keep the file) when
    that pod is replaced."""

    def __init__(self, path) -> None:
        self.path, self.names = path, {}
        self._write()

    def set(self, name: str, ip: str) -> None:
        self.names[name] = ip
        self._write()

    def _write(self) -> None:
        lines = ["127.0.0.1 localhost", *(f"{ip} {name}" for name, ip in self.names.items())]
        mode = "r+" if self.path.exists() else "w"
        with open(self.path, mode) as hosts:
            hosts.seek(0)
            hosts.write("\n".join(lines) + "\n")
            hosts.truncate()
        self.path.chmod(0o644)
