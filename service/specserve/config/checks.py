"""Check a config's engine settings before anything is redeployed.

An arm's `engine` block is handed to vLLM as engine arguments. A key vLLM does not know, a value
of the wrong type or outside its choices would otherwise surface only when Ray Serve starts the
arm's engine, minutes later and after the old engine is gone. vLLM's own command-line parser
checks each setting exactly as `vllm serve` would, without loading a model, so the same check
runs on a laptop for a GPU config. A packaged drafter (`package://NAME`) must be one shipped
inside the package's drafters directory; where the engines run on this machine (`specserve
serve`), drafter directories must exist, too. Drafter weights to load in place
(`drafter_weights`) must have the tensors of the arm's drafter, where both can be read here.
"""

from __future__ import annotations

import difflib
import functools
import json
from argparse import Action, ArgumentParser, BooleanOptionalAction
from pathlib import Path
from typing import Any

from specserve import drafter_checkpoint
from specserve.config.schema import PACKAGE_SCHEME, ConfigError, RouterConfig
from specserve.models import ModelError, resolve_drafter_source


class _RaisingParser:
    """vLLM's engine-argument parser, raising instead of exiting on a bad argument."""

    def __init__(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        class Parser(FlexibleArgumentParser):
            def error(self, message: str):  # type: ignore[override]
                raise ValueError(message)

        self.parser: ArgumentParser = AsyncEngineArgs.add_cli_args(Parser())
        self.actions: dict[str, Action] = {
            a.dest: a for a in self.parser._actions if a.option_strings
        }

    def problems(self, engine: dict[str, Any]) -> list[str]:
        found = []
        for key, value in engine.items():
            action = self.actions.get(key)
            if action is None:
                near = difflib.get_close_matches(key, self.actions, n=1)
                hint = f" (did you mean `{near[0]}`?)" if near else ""
                found.append(f"`{key}` is not a vLLM engine argument{hint}")
                continue
            try:
                self.parser.parse_args(["--model", "m", *_argv(action, value)])
            except ValueError as exc:
                found.append(f"`{key}`: {exc}")
        return found


@functools.cache
def _parser() -> _RaisingParser:
    return _RaisingParser()


def _argv(action: Action, value: Any) -> list[str]:
    """`key: value` as vLLM's command line spells it."""
    option = next(o for o in action.option_strings if o.startswith("--"))
    if isinstance(value, bool) and isinstance(action, BooleanOptionalAction):
        return [option] if value else ["--no-" + option.removeprefix("--")]
    if isinstance(value, bool) and action.nargs == 0:  # store_true
        return [option] if value else []
    if isinstance(value, list) and action.nargs in ("*", "+"):
        return [option, *(str(item) for item in value)]
    if isinstance(value, dict | list):
        return [option, json.dumps(value)]
    return [option, str(value)]


def engine_problems(config: RouterConfig, *, engines_run_here: bool = False) -> list[str]:
    """What vLLM would reject in each arm's `engine` settings, packaged drafters that are not
    shipped inside the drafters directory (and, with `engines_run_here`, drafter directories
    that do not exist on this machine)."""
    problems = []
    for arm in config.arms:
        for problem in _parser().problems(arm.engine):
            problems.append(f"arm {arm.name!r}: engine: {problem}")
        model = getattr(arm.speculative, "model", None)
        if model and model.startswith(PACKAGE_SCHEME):
            try:
                resolve_drafter_source(model)
            except ModelError as exc:
                problems.append(f"arm {arm.name!r}: {exc}")
        if engines_run_here and model and _names_a_directory(model) and not Path(model).is_dir():
            problems.append(f"arm {arm.name!r}: drafter directory {model} does not exist")
        if arm.drafter_weights is not None and model:
            misfit = _weights_misfit(arm.drafter_weights, model, engines_run_here)
            if misfit:
                problems.append(f"arm {arm.name!r}: drafter_weights: {misfit}")
    return problems


def _weights_misfit(weights: str, model: str, engines_run_here: bool) -> str | None:
    """Why `weights` cannot be loaded into the drafter of `model`, where both can be read here
    (a packaged drafter always can; directories, where the engines run on this machine)."""
    try:
        paths = [resolve_drafter_source(source) for source in (weights, model)]
    except ModelError as exc:
        return str(exc)
    readable = [
        source.startswith(PACKAGE_SCHEME) or (engines_run_here and _names_a_directory(source))
        for source in (weights, model)
    ]
    if not readable[0] or not readable[1]:
        return None  # read where the engines run: a misfit is logged there, and nothing loaded
    if not Path(paths[0]).is_dir():
        return f"directory {weights} does not exist"
    return drafter_checkpoint.misfit(paths[0], paths[1])


def check_engine_settings(
    config: RouterConfig, *, source: str, engines_run_here: bool = False
) -> None:
    problems = engine_problems(config, engines_run_here=engines_run_here)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))


def _names_a_directory(model: str) -> bool:
    # A hub id (`org/name`) is resolved by vLLM; paths start with `/`, `.` or `~`.
    return not model.startswith(PACKAGE_SCHEME) and model.startswith(("/", ".", "~"))
