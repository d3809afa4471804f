"""The suite's run order (tests/conftest.py): after pytest-randomly's shuffle, tests with a Ray
cluster of their own first, disruptive ones last, the shuffled order kept within each group."""

from __future__ import annotations

import pytest

from tests import conftest


class Item:
    def __init__(self, name: str, marker: str | None = None, module: str = "m") -> None:
        self.name, self.marker = name, marker
        self.nodeid = f"tests/{module}.py::{name}"

    def get_closest_marker(self, name: str):
        return name if name == self.marker else None


def test_own_cluster_first_disruptive_last_shuffled_order_kept():
    items = [
        Item("a"),
        Item("kill", "disruptive"),
        Item("b"),
        Item("own-1", "own_cluster"),
        Item("c"),
        Item("own-2", "own_cluster"),
    ]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [i.name for i in items] == ["own-1", "own-2", "a", "b", "c", "kill"]


def test_modules_stay_together_and_their_e2e_tests_come_last_in_them():
    items = [
        Item("x-loop", "e2e", module="x"),
        Item("y-1", module="y"),
        Item("x-1", module="x"),
        Item("y-e2e", "e2e", module="y"),
        Item("x-2", module="x"),
    ]
    conftest.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [i.name for i in items] == ["x-1", "x-2", "x-loop", "y-1", "y-e2e"]


def test_randomly_shuffles_before_the_grouping(pytestconfig):
    """pytest-randomly reorders in a hook wrapper, before plain implementations like ours."""
    plugin = pytestconfig.pluginmanager.get_plugin("randomly")
    if plugin is None:
        pytest.skip("run with -p no:randomly")
    hook = plugin.pytest_collection_modifyitems
    assert hook.pytest_impl["wrapper"] and hook.pytest_impl["tryfirst"]  # type: ignore[attr-defined]


def test_a_test_with_its_own_cluster_refuses_to_end_another(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    with pytest.raises(pytest.fail.Exception, match="own_cluster"), conftest.own_ray_cluster():
        pass
