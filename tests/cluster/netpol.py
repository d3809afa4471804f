"""A rendered NetworkPolicy as nftables rules: what a NetworkPolicy-enforcing CNI does.

For each pod the policy selects, its namespace gets a table whose input and output chains drop
by default and accept: replies of accepted connections, loopback (a pod's own containers), the
node's address (kubelet's probes: Kubernetes always allows a pod's node), and each ingress /
egress rule as the Kubernetes API defines it. A rule's peers are resolved to the addresses of
the endpoints they select: `podSelector` alone selects pods of the policy's namespace,
`namespaceSelector` alone every endpoint of the matching namespaces (an empty one: every
namespace), both together the matching pods in the matching namespaces, `ipBlock` its CIDR less
`except`. The rules are loaded again whenever a pod comes or goes, as a CNI follows the pods'
addresses. A rule without peers allows every address, one without ports every port; a named
port is looked up among the selected pods' container ports. Not covered: `endPort`,
`matchExpressions` (refused), SCTP.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

from tests.cluster.network import Endpoint, sh

TABLE = "netpol"


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return True
    if selector.get("matchExpressions"):
        raise NotImplementedError("matchExpressions are not translated")
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def namespace_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}  # the label Kubernetes sets on each


def peer_addresses(
    peer: dict[str, Any], policy_namespace: str, endpoints: Iterable[Endpoint]
) -> list[str]:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        net = ipaddress.ip_network(block["cidr"])
        if net.version != 4:
            return []  # the test network is IPv4
        kept = [net]
        for cut in block.get("except") or ():
            cut_net = ipaddress.ip_network(cut)
            kept = [part for n in kept for part in _subtract(n, cut_net)]
        return [str(n) for n in kept]
    pods, spaces = peer.get("podSelector"), peer.get("namespaceSelector")
    found = []
    for e in endpoints:
        if spaces is None:
            in_space = e.namespace == policy_namespace
        else:
            in_space = matches(spaces, namespace_labels(e.namespace))
        if in_space and matches(pods, e.labels):
            found.append(e.ip)
    return found


def _subtract(net, cut):
    if not net.overlaps(cut):
        return [net]
    if cut.supernet_of(net):
        return []
    return list(net.address_exclude(cut))


def rule_lines(
    rules: list[dict[str, Any]],
    direction: str,
    policy_namespace: str,
    endpoints: list[Endpoint],
    named_ports: dict[str, int],
) -> list[str]:
    """nft statements for a policy's ingress (`from`, source address) or egress (`to`,
    destination address) rules."""
    peers_key, addr = ("from", "ip saddr") if direction == "ingress" else ("to", "ip daddr")
    lines = []
    for rule in rules:
        peers = rule.get(peers_key)
        if peers is None:
            match_addr = ""
        else:
            addresses = sorted(
                {a for p in peers for a in peer_addresses(p, policy_namespace, endpoints)}
            )
            if not addresses:
                continue  # selects no one here
            match_addr = f"{addr} {{ {', '.join(addresses)} }} "
        ports = rule.get("ports")
        if not ports:
            lines.append(f"{match_addr}accept")
            continue
        for port in ports:
            protocol = str(port.get("protocol", "TCP")).lower()
            number = port.get("port")
            if isinstance(number, str) and not number.isdigit():
                number = named_ports[number]
            dport = (
                f"{protocol} dport {number} " if number is not None else f"meta l4proto {protocol} "
            )
            lines.append(f"{match_addr}{dport}accept")
    return lines


def ruleset(
    policy: dict[str, Any], endpoints: list[Endpoint], named_ports: dict[str, int], node: str
) -> str:
    spec = policy["spec"]
    namespace = policy["metadata"].get("namespace", "")
    types = spec.get("policyTypes") or ["Ingress"]
    chains = []
    for hook, kind, direction in (("input", "Ingress", "ingress"), ("output", "Egress", "egress")):
        if kind in types:
            body = rule_lines(
                spec.get(direction) or [], direction, namespace, endpoints, named_ports
            )
            policy_line = "drop"
        else:
            body, policy_line = [], "accept"
        own = "iif lo accept" if hook == "input" else "oif lo accept"
        # Traffic between a pod and its node (kubelet's HTTP probes) is always allowed.
        kubelet = f"ip saddr {node} accept" if hook == "input" else f"ip daddr {node} accept"
        statements = ["ct state established,related accept", own, kubelet, *body]
        chains.append(
            f"  chain {hook} {{\n    type filter hook {hook} priority 0; policy {policy_line};\n"
            + "".join(f"    {s}\n" for s in statements)
            + "  }\n"
        )
    # Declared, deleted and declared again: loading it replaces the pod's rules in one go.
    replace = f"table inet {TABLE}\ndelete table inet {TABLE}\n"
    return f"{replace}table inet {TABLE} {{\n{''.join(chains)}}}\n"


def enforce(
    policy: dict[str, Any], pod: Endpoint, endpoints: list[Endpoint], named_ports, node: str
) -> str:
    """Load the policy's rules into the pod's network namespace (again when the pods it names
    change: a CNI follows the pods' addresses); the ruleset loaded."""
    text = ruleset(policy, endpoints, named_ports, node)
    sh("ip", "netns", "exec", pod.netns, "nft", "-f", "-", input=text)
    return text
