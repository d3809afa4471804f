"""`specserve ...`: serve the platform, check and compare configs, prepare models."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from specserve import drafter_commands
from specserve.config.changes import diff_configs
from specserve.config.checks import check_engine_settings
from specserve.config.schema import (
    ConfigError,
    RouterConfig,
    load_config,
    parse_config,
    read_config_file,
)
from specserve.config.store import DEFAULT_KEEP, ConfigStore, StoreError
from specserve.models import ModelError

_CONFIGURED = Path("<configured>")  # `--local` without a file: the configured one


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    adapt_args = drafter_commands.adapt_arguments()

    serve_p = sub.add_parser("serve", help="start Ray, the arms and the router; Ctrl-C stops all")
    serve_p.add_argument("--config", type=Path, help="config YAML (default: $SPECSERVE_CONFIG)")

    config_p = sub.add_parser("config", help="check or compare config files")
    config_sub = config_p.add_subparsers(dest="config_command", required=True)
    validate_p = config_sub.add_parser("validate", help="validate a config file")
    validate_p.add_argument("file", type=Path)
    diff_p = config_sub.add_parser("diff", help="what changes from config A to config B")
    diff_p.add_argument("a", type=Path)
    diff_p.add_argument("b", type=Path)
    serve_config_p = config_sub.add_parser(
        "serve-config",
        help="the Ray Serve config (router app + one app per arm) for `serve deploy` or a "
        "RayService's serveConfigV2",
    )
    serve_config_p.add_argument("file", type=Path)
    serve_config_p.add_argument(
        "--config-path",
        help="where the router reads the config file at run time "
        "(default: the ConfigMap mount path of the Helm chart)",
    )
    # The live config of a release on Kubernetes (specserve/config/cluster_store.py).
    cluster_args = argparse.ArgumentParser(add_help=False)
    cluster_args.add_argument("--release", default="specserve", help="Helm release (specserve)")
    cluster_args.add_argument(
        "-n", "--namespace", help="default: the kubeconfig context's namespace, else `default`"
    )
    cluster_args.add_argument("--context", help="kubeconfig context (default: the current one)")
    cluster_args.add_argument("--kubeconfig", help="default: $KUBECONFIG, else ~/.kube/config")
    cluster_args.add_argument(
        "--local",
        nargs="?",
        const=_CONFIGURED,
        type=Path,
        metavar="FILE",
        help="the config file a local `specserve serve` runs from (default: $SPECSERVE_CONFIG) "
        "instead of a release on Kubernetes; history in FILE.history/",
    )
    apply_p = config_sub.add_parser(
        "apply",
        parents=[cluster_args],
        help="validate a file and make it a release's live config, recorded in its history",
    )
    apply_p.add_argument("file", type=Path)
    apply_p.add_argument(
        "--keep",
        type=_positive_int,
        default=DEFAULT_KEEP,
        help=f"history records kept at most ({DEFAULT_KEEP})",
    )
    config_sub.add_parser(
        "history", parents=[cluster_args], help="a release's applied configs, newest first"
    )
    rollback_p = config_sub.add_parser(
        "rollback",
        parents=[cluster_args],
        help="restore a recorded config (default: the one applied before the live one)",
    )
    rollback_p.add_argument("--to", metavar="REVISION", help="a revision or a unique prefix")

    drain_p = sub.add_parser(
        "drain-node",
        help="drain this pod's Ray node and wait for its requests (the chart's preStop hook)",
    )
    drain_p.add_argument(
        "--within-s", type=float, required=True, help="give up waiting after this many seconds"
    )
    drain_p.add_argument("--metrics-port", type=int, default=8080, help="Ray's metrics export port")

    model_p = sub.add_parser("model", help="target models")
    model_sub = model_p.add_subparsers(dest="model_command", required=True)
    prepare_p = model_sub.add_parser("prepare", help="convert the configured model once")
    prepare_p.add_argument("--config", type=Path)
    prepare_p.add_argument("--force", action="store_true", help="convert again")

    drafter_p = sub.add_parser("drafter", help="train and evaluate EAGLE-3 / EAGLE-3.1 drafters")
    drafter_commands.add_arguments(drafter_p, adapt_args)

    bench_p = sub.add_parser(
        "bench",
        help="per-arm speed side by side at several concurrency levels (vLLM's serving benchmark)",
    )
    from specserve.bench import serving

    serving.add_arguments(bench_p)

    ab_p = sub.add_parser("ab", help="A/B verdicts on live traffic")
    ab_sub = ab_p.add_subparsers(dest="ab_command", required=True)
    report_p = ab_sub.add_parser(
        "report",
        help="each arm against a baseline from Prometheus, with always-valid confidence intervals",
    )
    from specserve.ab import report

    report.add_arguments(report_p)

    loop_p = sub.add_parser(
        "loop",
        parents=[cluster_args, adapt_args],
        help="adapt a drafter, prove it as a challenger arm on live traffic, promote or remove it",
    )
    from specserve import loop_commands

    loop_commands.add_arguments(loop_p)

    tune_p = sub.add_parser(
        "tune",
        parents=[cluster_args],
        help="k by load: measure round costs and live acceptance, write each drafting arm's "
        "k schedule as a config revision",
    )
    from specserve import tune

    tune.add_arguments(tune_p)

    capture_p = sub.add_parser("capture", help="the arms' capture samples: show or delete them")
    from specserve.capture import commands as capture_commands

    capture_commands.add_arguments(capture_p)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per Prometheus query
    try:
        if args.command == "serve":
            return _serve(args.config)
        if args.command == "config" and args.config_command == "validate":
            loaded = load_config(args.file)
            check_engine_settings(loaded.config, source=str(args.file))
            arms = ", ".join(f"{a.name}={a.weight:g}" for a in loaded.config.arms)
            print(f"{args.file}: valid, revision {loaded.revision}; arms: {arms}")
            return 0
        if args.command == "config" and args.config_command == "diff":
            a, b = load_config(args.a), load_config(args.b)
            print(f"revision {a.revision} -> {b.revision}")
            lines = diff_configs(a.config, b.config)
            print("\n".join(lines) if lines else "no changes")
            return 0
        if args.command == "config" and args.config_command == "serve-config":
            import yaml

            from specserve.config.serve_config import MOUNTED_CONFIG_PATH, serve_config

            loaded = load_config(args.file)
            document = serve_config(
                loaded.config, config_path=args.config_path or MOUNTED_CONFIG_PATH
            )
            print(f"# Serve config of {args.file} (revision {loaded.revision}): `serve deploy` it,")
            print("# or put it under a RayService's spec.serveConfigV2")
            print(yaml.safe_dump(document, sort_keys=False), end="")
            return 0
        if args.command == "config" and args.config_command in ("apply", "history", "rollback"):
            return config_command(args)
        if args.command == "drain-node":
            from specserve.node_drain import drain_node

            result = drain_node(args.within_s, metrics_port=args.metrics_port)
            print(
                f"node {result.node_id} drained in {result.waited_s:.1f} s; at the end "
                f"{result.replicas_left} Serve replica(s) to move, {result.in_flight} request(s) "
                "in flight on it"
                + (
                    " (every other node drains too: its replicas stop with it)"
                    if result.stranded
                    else ""
                )
            )
            return 0
        if args.command == "model" and args.model_command == "prepare":
            from specserve.models import prepare_model

            path = _config_path(args.config)
            print(prepare_model(load_config(path).config.model.source, force=args.force))
            return 0
        if args.command == "bench":
            from specserve.bench import serving

            return serving.run(args)
        if args.command == "ab":
            from specserve.ab import report

            return report.run(args)
        if args.command == "loop":
            from specserve import loop_commands

            return loop_commands.run(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "capture":
            from specserve.capture import commands as capture_commands

            return capture_commands.run(args)
        if args.command == "drafter":
            return drafter_commands.run(args)
    except (ConfigError, StoreError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser.error("unknown command")
    return 2


def open_store(args: argparse.Namespace, check: str | None = None) -> ConfigStore:
    """The live config's store: the local file (`--local`) or a release on Kubernetes. With
    `check`, every config applied through it is checked with vLLM's own argument parser first,
    and named so in an error."""
    from functools import partial

    checked = None if check is None else partial(check_engine_settings, source=check)
    if args.local:
        from specserve.config.local_store import LocalStore

        path = _config_path(None) if args.local == _CONFIGURED else args.local
        if not path.is_file():
            raise StoreError(f"{path}: no config file there (--local FILE, or $SPECSERVE_CONFIG)")
        return LocalStore(path, check=checked)
    from specserve.config.cluster_store import Cluster, ClusterStore

    cluster = Cluster.connect(
        release=args.release,
        namespace=args.namespace,
        context=args.context,
        kubeconfig=args.kubeconfig,
    )
    return ClusterStore(cluster, check=checked)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _validated(path: Path) -> tuple[str, RouterConfig]:
    """A config file's text and config; the bytes validated are the bytes applied (one read)."""
    raw = read_config_file(path)
    config = parse_config(raw, source=str(path))
    check_engine_settings(config, source=str(path))
    try:
        return raw.decode("utf-8"), config
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text, which a ConfigMap needs") from None


def config_command(args: argparse.Namespace) -> int:
    """`config apply | history | rollback`, on the local file (`--local`) or a release."""
    if args.config_command == "apply":
        # Validated before anything talks to the store: a bad file never gets there.
        text, config = _validated(args.file)
    store = open_store(args)
    if args.config_command == "history":
        print("\n".join(store.history()))
        return 0
    if args.config_command == "apply":
        outcome = store.apply(text, config, keep=args.keep)
    else:
        outcome = store.rollback(args.to)
    if not outcome.changed:
        print(f"revision {outcome.new_revision} is already live in {outcome.where}; nothing to do")
        return 0
    verb = "applied" if args.config_command == "apply" else "rolled back"
    print(f"{verb}: {outcome.where}: revision {outcome.old_revision} -> {outcome.new_revision}")
    if outcome.old_config is not None:
        print("\n".join(diff_configs(outcome.old_config, outcome.new_config)) or "  no changes")
    print("\n".join(store.notes(outcome)))
    if outcome.pruned:
        print(f"history: deleted {', '.join(outcome.pruned)} (keeping {args.keep})")
    return 0


def _tune(args: argparse.Namespace) -> int:
    """`specserve tune` against the local config file (`--local`) or a release."""
    from specserve import tune

    if not args.local and args.costs is None:
        print(
            "error: on Kubernetes the round costs must come from a node of the arms' kind: run "
            "`python -m specserve.bench.round_cost --out DIR` in a worker pod and pass "
            "--costs DIR (or tune a local platform with --local)",
            file=sys.stderr,
        )
        return 2
    return tune.run(args, open_store(args, check="the tuned revision"))


def _config_path(explicit: Path | None) -> Path:
    """The config a command acts on: `explicit`, else the local platform's (local_store.py)."""
    from specserve.config.local_store import local_config_path
    from specserve.config.settings import get_settings

    return explicit or local_config_path(get_settings())


def serving_config(explicit: Path | None) -> tuple[Path, bool]:
    """The file `specserve serve` runs from, and whether it is the cache dir's copy of the
    packaged default (rather than the file given or configured)."""
    from specserve.config.settings import get_settings

    path = _config_path(explicit)
    return path, explicit is None and path != get_settings().config


def _serve(config: Path | None) -> int:
    from specserve.config.settings import get_settings
    from specserve.deploy import DeployError, Platform

    path, copied = serving_config(config)
    # Every process of the platform (the router's replicas too) reads the config from here.
    os.environ["SPECSERVE_CONFIG"] = str(path)
    get_settings.cache_clear()
    settings = get_settings()
    started = time.monotonic()
    try:
        platform = Platform(settings)
        platform.preflight()  # at once: before Ray starts, before any signal handling
    except DeployError as exc:
        print(f"specserve: {exc}", file=sys.stderr)
        return 2
    state = {"up": False, "stop": False, "stopping": False}

    def _on_signal(signum, frame):  # noqa: ARG001
        """Ctrl-C or SIGTERM, at any moment: during start-up it aborts the start at once; once
        up, the loop below stops. A second one while stopping changes nothing."""
        if state["stopping"]:
            print("already stopping ...", flush=True)
            return
        state["stop"] = True
        if not state["up"]:
            raise KeyboardInterrupt

    def _handle_signals() -> None:
        # Also where the shell started us with SIGINT ignored; ray.init sets its own SIGTERM
        # handler, so this runs again after it.
        signal.signal(signal.SIGINT, _on_signal)
        signal.signal(signal.SIGTERM, _on_signal)

    _handle_signals()
    try:
        platform.connect()
        _handle_signals()
        platform.deploy(platform.loaded)
        platform.wait_until_running(timeout_s=900)
        state["up"] = True
        loaded = platform.loaded
        print(
            f"\nspecserve is up after {time.monotonic() - started:.0f} s\n"
            f"  API:     http://{settings.host}:{settings.port}/v1\n"
            f"  metrics: http://{settings.host}:{settings.metrics_port}/metrics\n"
            f"  config:  {platform.config_path} (revision {loaded.revision})\n"
            + (
                "           (a copy of the packaged default: `specserve config apply --local` "
                "changes it; delete it to start again from the default)\n"
                if copied
                else ""
            )
            + f"  model:   {loaded.config.model.name}\n"
            f"  keys:    {settings.api_keys_file or 'none: no API key needed'}\n"
            + "".join(f"  arm {a.name}: weight {a.weight:g}\n" for a in loaded.config.arms)
            + "Ctrl-C stops everything.",
            flush=True,
        )
        watcher = platform.watcher()
        while not state["stop"]:
            time.sleep(settings.config_poll_s)
            try:
                watcher.check()
            except Exception:
                logging.getLogger(__name__).exception("applying the new config failed")
    except KeyboardInterrupt:
        print("\ninterrupted during start-up", flush=True)
    finally:
        state["stopping"] = True
        print("stopping ...", flush=True)
        platform.stop(drain=state["up"])
        print(f"stopped after {time.monotonic() - started:.0f} s", flush=True)
    return 0 if state["up"] else 130


if __name__ == "__main__":
    sys.exit(main())
