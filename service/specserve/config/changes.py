"""How two router configs differ, and what each difference does: applied live by the router,
applied in place to the running engines, or a redeploy of an arm's engines.

`specserve config diff` says it of two files, `config apply` and `rollback` of the live config
and the one they write, and both stores (store.py) report which engines a switch redeploys; all of
them classify an arm's change with `arm_change`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from specserve.config.schema import (
    DEPLOYMENT_OPTIONS,
    RELOADED_IN_PLACE,
    ROUTER_SIDE,
    ArmConfig,
    ArmEngineConfig,
    ModelConfig,
    RouterConfig,
)

ArmChangeKind = Literal["unchanged", "in place", "restart", "added", "removed"]


@dataclass(frozen=True)
class ArmChange:
    """How one arm changes between two configs, compared on the normalised config (every default
    filled in, so writing a default out or leaving it out is no change):

    - `restart`: its engine changes (the model, `speculative`, `engine`, `env`, ...): Ray Serve
      starts new engine replicas (`restart` names the keys, `model` first when it changed);
    - `in place`: only its weight or capture (live, in the router), its replicas and queue
      bounds (`DEPLOYMENT_OPTIONS`, applied to the running engines) or its drafter weights
      (`RELOADED_IN_PLACE`, loaded by the running engines) change (`in_place` names those but
      the weight);
    - `unchanged`, `added`, `removed`.

    `specserve config diff` and `config apply` both classify with `arm_change`."""

    name: str
    kind: ArmChangeKind
    weight: tuple[float, float] | None = None  # (old, new) when it changed
    in_place: tuple[str, ...] = ()
    restart: tuple[str, ...] = ()


ArmSide = tuple[ModelConfig, ArmEngineConfig]


def arm_change(name: str, old: ArmSide | None, new: ArmSide | None) -> ArmChange:
    """The change of arm `name` from `old` to `new` (model and arm; None: not there). Weights
    count where both sides have one (an `ArmConfig`; a running engine has none)."""
    if old is None or new is None:
        if old is None and new is None:
            raise ValueError(f"arm {name} is on neither side")
        return ArmChange(name, "added" if old is None else "removed")
    (old_model, old_arm), (new_model, new_arm) = old, new
    before = old_arm.model_dump(mode="json", exclude=set(ROUTER_SIDE))
    after = new_arm.model_dump(mode="json", exclude=set(ROUTER_SIDE))
    changed = [key for key in after if before.get(key) != after[key]]
    live = {*DEPLOYMENT_OPTIONS, *RELOADED_IN_PLACE}
    restart = tuple(key for key in changed if key not in live)
    if old_model != new_model:
        restart = ("model", *restart)
    in_place = tuple(key for key in changed if key in live)
    # Like the weight, the capture counts where both sides have one (a running engine has none).
    both = isinstance(old_arm, ArmConfig) and isinstance(new_arm, ArmConfig)
    if both and old_arm.capture != new_arm.capture:  # type: ignore[attr-defined]
        in_place = (*in_place, "capture")
    old_weight, new_weight = getattr(old_arm, "weight", None), getattr(new_arm, "weight", None)
    weight = None
    if old_weight is not None and new_weight is not None and old_weight != new_weight:
        weight = (old_weight, new_weight)
    kind: ArmChangeKind = (
        "restart" if restart else "in place" if in_place or weight else "unchanged"
    )
    return ArmChange(name, kind, weight, in_place, restart)


def arm_changes(old: RouterConfig, new: RouterConfig) -> list[ArmChange]:
    """Every arm of either config: those of `new` in its order, then the removed ones."""
    before = {arm.name: (old.model, arm) for arm in old.arms}
    after = {arm.name: (new.model, arm) for arm in new.arms}
    names = [*after, *(name for name in before if name not in after)]
    return [arm_change(name, before.get(name), after.get(name)) for name in names]


@dataclass(frozen=True)
class ArmChanges:
    """The engines a switch touches: arms Ray Serve redeploys (new, or a changed engine),
    rescales in place (only replica or queue settings changed), whose running engines load
    other drafter weights, and deletes."""

    redeployed: tuple[str, ...] = ()
    rescaled: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    reloaded: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.redeployed or self.rescaled or self.removed or self.reloaded)

    @classmethod
    def of(cls, changes: Iterable[ArmChange]) -> ArmChanges:
        """The engine part of `changes`: a weight or capture change alone touches no engine."""
        changes = list(changes)
        return cls(
            redeployed=tuple(c.name for c in changes if c.kind in ("added", "restart")),
            rescaled=tuple(
                c.name
                for c in changes
                if c.kind == "in place" and any(k in DEPLOYMENT_OPTIONS for k in c.in_place)
            ),
            removed=tuple(c.name for c in changes if c.kind == "removed"),
            reloaded=tuple(
                c.name
                for c in changes
                if c.kind == "in place" and any(k in RELOADED_IN_PLACE for k in c.in_place)
            ),
        )

    def describe(self) -> str:
        """`redeploys a, b; rescales c in place; deletes d`."""
        what = [f"redeploys {', '.join(self.redeployed)}"] if self.redeployed else []
        what += [f"rescales {', '.join(self.rescaled)} in place"] if self.rescaled else []
        what += (
            [f"reloads the drafter weights of {', '.join(self.reloaded)} in place"]
            if self.reloaded
            else []
        )
        what += [f"deletes {', '.join(self.removed)}"] if self.removed else []
        return "; ".join(what)


def diff_configs(a: RouterConfig, b: RouterConfig) -> list[str]:
    """Human-readable changes, each saying whether it applies live or redeploys an arm; arms
    classified as `config apply` classifies them (`arm_changes`)."""
    lines = []
    for section in ("routing", "limits"):
        old, new = getattr(a, section).model_dump(), getattr(b, section).model_dump()
        for key in sorted(old):
            if old[key] != new[key]:
                lines.append(f"  {section}.{key}: {old[key]!r} -> {new[key]!r} (live)")
    if a.model != b.model:
        lines.append(f"  model: {a.model.model_dump()} -> {b.model.model_dump()} (redeploys all)")
    changes = sorted(arm_changes(a, b), key=lambda change: change.name)
    weights = {arm.name: arm.weight for arm in b.arms}
    for change in changes:
        if change.kind == "removed":
            lines.append(f"- arm {change.name} (removed; its engine is deleted)")
    for change in changes:
        if change.kind == "added":
            lines.append(f"+ arm {change.name} weight {weights[change.name]:g} (new engine)")
    for change in changes:
        name = change.name
        if change.weight is not None:
            old_weight, new_weight = change.weight
            lines.append(f"~ arm {name} weight {old_weight:g} -> {new_weight:g} (live)")
        engine = [key for key in change.restart if key != "model"]
        if engine:
            lines.append(f"~ arm {name} {', '.join(engine)} changed (redeploys this arm)")
        if "capture" in change.in_place:
            lines.append(f"~ arm {name} capture changed (live)")
        engines = [key for key in change.in_place if key != "capture"]
        if engines:
            lines.append(
                f"~ arm {name} {', '.join(engines)} changed (applied to the running engines)"
            )
    return lines
