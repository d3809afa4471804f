"""The release as the Kubernetes API holds it, for the harness's upgrades: the chart's live
router ConfigMap and its RayService in the API server stand-in (tests/deploy/kube_standin.py:
the Kubernetes wire protocol, field ownership as server-side apply keeps it).

Written as on a cluster:
- by Helm 4: `install`, `upgrade` and `rollback` apply the chart's objects server-side, whole,
  under field manager `helm`, forcing only with `force_conflicts` (`--force-conflicts`). The
  render is the real Helm engine's (helm-python-sdk); on an upgrade its `lookup` calls find the
  live objects in the stand-in (tests/deploy/conftest.py `render_upgrade`), and a chart that
  `fail`s stops the upgrade before anything is applied. Each revision's manifest is kept, and
  `rollback` applies a kept one without rendering, as Helm does;
- by the real `specserve config apply` / `config rollback`, through the `kubernetes` client
  and a kubeconfig pointing at the stand-in (`kubeconfig`).

Only these two objects are held: the Secrets, policies and dashboards the chart also renders do
not change between the harness's revisions. What the cluster does with the objects is
harness.py's `sync` (kubelet's ConfigMap update, KubeRay's reaction to the RayService).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.cluster import kuberay
from tests.deploy.conftest import generate, release_objects, render_upgrade
from tests.deploy.kube_standin import CONFIGMAPS, RAYSERVICES, KubeStandin


class Release:
    def __init__(self, root: Path, values: dict[str, Any], installed: list[dict[str, Any]]):
        """`helm install` with `values`, which rendered `installed`."""
        self.root = root
        self.api = KubeStandin().start()
        self.kubeconfig = self.api.write_kubeconfig(root / "kubeconfig", kuberay.NAMESPACE)
        # Each revision's values and manifest, by revision - 1.
        self.revisions: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
        self.renders = 0
        self._apply(values, release_objects(installed, kuberay.NAMESPACE))

    @property
    def revision(self) -> int:
        return len(self.revisions)

    @property
    def values(self) -> dict[str, Any]:
        """The values of the release's current revision."""
        return self.revisions[-1][0]

    # -- Helm ------------------------------------------------------------------------------

    def upgrade(self, values: dict[str, Any], *, force_conflicts: bool = False) -> int:
        """`helm upgrade`: the chart rendered with the live objects found by `lookup`, then
        applied. Raises helm_python.HelmRenderError where the chart refuses, the stand-in's
        ApiError (409) on a field conflict; either leaves the objects as they were. Returns
        the new revision."""
        self.renders += 1
        rendered = render_upgrade(
            values,
            self.rayservice(),
            self.root / f"render-{self.renders}",
            self.config_map(),
            name=kuberay.RELEASE,
            namespace=kuberay.NAMESPACE,
        )
        objects = release_objects(generate.objects(rendered), kuberay.NAMESPACE)
        return self._apply(values, objects, force_conflicts=force_conflicts)

    def rollback(self, revision: int, *, force_conflicts: bool = False) -> int:
        """`helm rollback RELEASE revision`: that revision's manifest applied again as it was
        rendered then (no lookup now). Returns the new revision."""
        values, objects = self.revisions[revision - 1]
        return self._apply(values, objects, force_conflicts=force_conflicts)

    def _apply(self, values, objects, *, force_conflicts: bool = False) -> int:
        # Helm 4's server-side apply, object by object in install order; a failed one ends the
        # command and records no revision here.
        for obj in objects:
            self.api.add(obj, manager="helm", force=force_conflicts)
        self.revisions.append((values, objects))
        return self.revision

    # -- specserve config ------------------------------------------------------------------

    @contextlib.contextmanager
    def kube_env(self) -> Iterator[None]:
        """The operator's shell for `specserve config ...`: KUBECONFIG naming the stand-in."""
        before = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = str(self.kubeconfig)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = before

    def config(self, *args: str) -> int:
        """`specserve config ARGS --release RELEASE` against the API (the namespace from the
        kubeconfig's context)."""
        from specserve.cli import main

        with self.kube_env():
            return main(["config", *args, "--release", kuberay.RELEASE])

    # -- what the API holds ----------------------------------------------------------------

    def rayservice(self) -> dict[str, Any]:
        name = self.revisions[0][1][1]["metadata"]["name"]
        found = self.api.get(RAYSERVICES.plural, kuberay.NAMESPACE, name)
        assert found is not None
        return found

    def config_map(self) -> dict[str, Any]:
        name = self.revisions[0][1][0]["metadata"]["name"]
        found = self.api.get(CONFIGMAPS.plural, kuberay.NAMESPACE, name)
        assert found is not None
        return found

    def live_config(self) -> str:
        return self.config_map()["data"]["config.yaml"]

    def close(self) -> None:
        self.api.stop()
