"""YAML read with bounds: a config document refused for its size, its depth or aliases that
multiply its nodes, before anything expands it."""

from __future__ import annotations

from typing import Any

import yaml

# A config document is at most this large: the ConfigMap that carries it on Kubernetes holds at
# most 1 MiB, and the router reads the file on every change.
MAX_CONFIG_BYTES = 1 << 20
# YAML aliases may share a node (an `&engine` anchor used by every arm) but not multiply it: a
# document of a few hundred bytes whose nested aliases expand to billions of nodes ("billion
# laughs") would take the validators, the engine check and the Serve config that long. A real
# config is a few hundred nodes, expanded.
MAX_CONFIG_NODES = 100_000
# Deeper nesting than any config needs (it has 7 levels) would exhaust Python's recursion.
MAX_CONFIG_DEPTH = 32


class RefusedDocument(Exception):
    """A YAML document refused for its size, its aliases or its depth."""


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that counts every node as if each alias were a copy of its anchor and
    refuses a document past MAX_CONFIG_NODES such nodes or MAX_CONFIG_DEPTH levels while it is
    being read: an alias bomb is refused a few levels in, before anything expands it."""

    def __init__(self, stream: bytes | str) -> None:
        super().__init__(stream)
        self._expanded: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            anchor = self.anchors.get(event.anchor)
            if anchor is not None and id(anchor) not in self._expanded:
                raise RefusedDocument(f"alias *{event.anchor} is inside its own anchor")
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_CONFIG_DEPTH:
            raise RefusedDocument(f"nested deeper than {MAX_CONFIG_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        children: list[Any] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        size = 1 + sum(self._expanded[id(child)] for child in children)
        if size > MAX_CONFIG_NODES:
            raise RefusedDocument(
                f"its aliases expand to more than {MAX_CONFIG_NODES} nodes (an alias bomb)"
            )
        self._expanded[id(node)] = size
        return node


def load_yaml(raw: bytes | str) -> Any:
    """One YAML document as plain data, like yaml.safe_load, but refusing one larger than
    MAX_CONFIG_BYTES, nested deeper than MAX_CONFIG_DEPTH or whose aliases expand past
    MAX_CONFIG_NODES nodes (RefusedDocument)."""
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > MAX_CONFIG_BYTES:
        raise RefusedDocument(f"{size} bytes, more than {MAX_CONFIG_BYTES}")
    loader = _BoundedLoader(raw)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
