"""`specserve loop`: adapt a drafter, prove it as a challenger on live traffic, promote or remove
it (the steps are loop.py's), against the local config file (`--local`) or a release; `--abort`
and `--undo` act on the loop recorded in the work directory."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
import time
from pathlib import Path

from specserve import cli, drafter_commands
from specserve.config.schema import MAX_LEFT_OUT_PROMPTS, parse_config, revision_of
from specserve.config.store import ConfigStore


def add_arguments(loop_p: argparse.ArgumentParser) -> None:
    loop_p.add_argument("--incumbent", help="the EAGLE arm to improve (required for a loop)")
    loop_p.add_argument(
        "--prometheus", help="a Prometheus scraping specserve (required for a loop)"
    )
    loop_p.add_argument(
        "--candidate", type=drafter_commands.drafter_dir, help="skip adapt: this exported drafter"
    )
    loop_p.add_argument(
        "--share",
        type=float,
        default=0.5,
        help="challenger's share of the incumbent's weight, taken from it (0.5: the same load)",
    )
    loop_p.add_argument(
        "--challenger-cpus",
        metavar="CORES",
        help="CPU cores for the challenger's engine (its VLLM_CPU_OMP_THREADS_BIND, e.g. 2-3); "
        "default: the incumbent's, where the two slow each other alike. Cores of its own are "
        "fair only if nothing else runs on either engine's cores",
    )
    loop_p.add_argument("--poll-s", type=float, default=30.0)
    loop_p.add_argument("--max-wait-s", type=float, default=3600.0, help="for a verdict")
    loop_p.add_argument("--min-requests", type=int, default=30, help="per arm, for a verdict")
    loop_p.add_argument("--json", type=Path, help="write the loop's report here")
    loop_p.add_argument(
        "--max-error-share",
        type=float,
        default=0.05,
        help="the challenger goes once more of its requests than this fail (5xx)",
    )
    loop_p.add_argument(
        "--max-key-loss",
        type=float,
        default=0.1,
        help="no promotion while one key's requests are slower on the challenger by more than "
        "this share (0.1)",
    )
    ends = loop_p.add_mutually_exclusive_group()
    ends.add_argument(
        "--abort",
        action="store_true",
        help="stop the loop running on --work-dir (or take out the challenger of one that died)",
    )
    ends.add_argument(
        "--undo",
        action="store_true",
        help="roll the config back to the revision from before the last loop on --work-dir",
    )


def _loop_work_dir(args: argparse.Namespace) -> Path:
    from specserve.config.settings import get_settings

    return args.work_dir or get_settings().cache_dir / "adapt"


def run(args: argparse.Namespace) -> int:
    """`specserve loop` against the local config file (`--local`) or a release; `--abort` and
    `--undo` act on the loop recorded in the work directory."""
    from specserve import loop

    record = loop.RunRecord(_loop_work_dir(args))
    if args.abort:
        return _loop_abort(args, record)
    if args.undo:
        return _loop_undo(args, record)
    missing = [f"--{name}" for name in ("incumbent", "prometheus") if not getattr(args, name)]
    if missing:
        print(f"error: a loop needs {' and '.join(missing)}", file=sys.stderr)
        return 2
    store = cli.open_store(args, check="the loop's revision")
    try:
        stale = record.claim(args.incumbent, revision_of(store.live_text().encode()))
        if stale is not None:
            loop.remove_left_behind(stale, store)
    except loop.LoopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    outcome = loop.ABORTED
    try:
        code, outcome = _run_loop(args, store, record)
        return code
    finally:
        record.finish(outcome)


def _run_loop(args, store: ConfigStore, record) -> tuple[int, str]:  # noqa: ANN001
    """The loop's steps (loop.py's docstring); -> (exit code, outcome)."""
    import yaml

    from specserve import loop
    from specserve.ab.prometheus import Prometheus
    from specserve.config.schema import Eagle3Speculation

    config = loop.LoopConfig(
        incumbent=args.incumbent,
        share=args.share,
        poll_s=args.poll_s,
        max_wait_s=args.max_wait_s,
        min_requests=args.min_requests,
        max_error_share=args.max_error_share,
        max_key_loss=args.max_key_loss,
        challenger_cpus=args.challenger_cpus,
    )
    candidate, adapting, adapted = args.candidate, None, None
    if candidate is None:
        from specserve.drafter.adapt import adapt
        from specserve.models import prepare_model

        live = parse_config(store.live_text().encode(), source="the live config")
        incumbent = next((a for a in live.arms if a.name == args.incumbent), None)
        if incumbent is None or not isinstance(incumbent.speculative, Eagle3Speculation):
            print(f"error: no EAGLE arm {args.incumbent!r} in the live config", file=sys.stderr)
            return 2, loop.ABORTED
        base = args.base or incumbent.speculative.model
        adapting = drafter_commands.adapt_config(args, base, prepare_model(live.model.source))
        if args.k is None:  # the gate scores at the k the incumbent serves at
            adapting = drafter_commands.serving_k(adapting, incumbent)
        # ... and with the prompt lookup it serves with, which the winner will serve with too.
        adapting = drafter_commands.serving_lookup(adapting, incumbent)
        lookup = adapting.prompt_lookup_first
        print(
            f"scoring at num_speculative_tokens {adapting.k} ({adapting.k_source})"
            + (
                f", a prompt lookup of {lookup}+ tokens first (as {incumbent.name})"
                if lookup
                else ""
            )
        )
        try:
            adapted = adapt(adapting)
        except (SystemExit, Exception) as exc:  # adapt's refusal, or its run failing
            reason = f"adapt: {adapt_failure(exc)}"
            print(f"error: {reason}; nothing deployed", file=sys.stderr)
            return _ended_before_ab(args, 2, loop.ABORTED, reason)
        if not adapted["accepted"]:
            reason = adapted["verdict"]["reason"]
            print(f"{loop.NO_CANDIDATE}: {reason}; nothing deployed")
            return _ended_before_ab(args, 3, loop.NO_CANDIDATE, reason)
        candidate = Path(adapted["accepted"])
        from specserve.drafter.seen import training_digests

        left_out = training_digests(
            adapting.captured,
            adapting.arm,
            time.time(),
            adapting.held_out_share,
            adapting.validation_share,
        )
        if len(left_out) > MAX_LEFT_OUT_PROMPTS:
            print(
                f"{len(left_out)} prompts trained on, more than a config holds: the A/B leaves "
                f"out {MAX_LEFT_OUT_PROMPTS} of them"
            )
            left_out = frozenset(sorted(left_out)[:MAX_LEFT_OUT_PROMPTS])
        print(f"{len(left_out)} prompts trained on: their requests are left out of the A/B")
        config = dataclasses.replace(config, left_out_prompts=left_out)
    experiment = loop.Experiment(Prometheus(args.prometheus), config)
    record.name_challenger(candidate.resolve().name)  # the arm's name (loop.with_challenger)

    def _terminated(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt  # the loop removes its challenger on the way out

    signal.signal(signal.SIGTERM, _terminated)
    try:
        report = loop.Loop(config, store, experiment).run(candidate.resolve())
    except loop.LoopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2, loop.ABORTED
    except KeyboardInterrupt:
        print(
            "loop stopped before a verdict (the lines above say what became of its challenger)",
            file=sys.stderr,
        )
        return 130, loop.ABORTED
    except Exception as exc:
        print(f"error: the loop stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2, loop.ABORTED
    if report["steps"]:
        report["seen_in_training"] = traffic_seen(args, adapting if adapted else None, report)
    if args.json:
        loop.write_report(report, args.json)
    shown = ("outcome", "reason", "steps", "seen_in_training")
    print(yaml.safe_dump({k: report[k] for k in shown if k in report}, sort_keys=False))
    before = record.read() or {}
    if report["outcome"] == loop.PROMOTED:
        print(
            f"undo: `specserve loop --undo` (the same store and --work-dir) returns to revision "
            f"{before.get('revision_before')}, from before the loop"
        )
    return (0 if report["outcome"] == loop.PROMOTED else 3), report["outcome"]


def _ended_before_ab(args, code: int, outcome: str, reason: str) -> tuple[int, str]:  # noqa: ANN001
    """A loop that ended before any revision: its `--json` report says so, as every outcome's
    does."""
    if args.json:
        from specserve import loop

        report = {"outcome": outcome, "reason": reason, "steps": [], "rows": []}
        loop.write_report(report, args.json)
    return code, outcome


def traffic_seen(args, adapting, report: dict) -> dict:  # noqa: ANN001
    """How much of the A/B's traffic the candidate was trained on (drafter/seen.py); unknown
    for a `--candidate` this loop did not adapt."""
    if adapting is None:
        return {"unknown": "the candidate was not adapted by this loop: its training is not known"}
    from specserve.drafter.seen import ab_traffic_seen

    return ab_traffic_seen(
        adapting.captured,
        adapting.arm,
        args.incumbent,
        since=report["steps"][0]["at"],
        held_out_share=adapting.held_out_share,
        validation_share=adapting.validation_share,
    )


def adapt_failure(exc: BaseException) -> str:
    """One line for why adapt did not produce a candidate: its own message, or what stopped its
    Ray run, with what to change when the node ran out of memory."""
    if isinstance(exc, SystemExit):
        return str(exc.code)
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any(sign in text for sign in ("OutOfMemoryError", "low on memory", "memory pressure")):
        return (
            "a worker was killed for memory (the node was past Ray's memory threshold): fewer "
            "--workers, a lower --replay-share or a smaller capture sample"
        )
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _loop_abort(args: argparse.Namespace, record) -> int:  # noqa: ANN001
    """Stop the loop recorded in the work directory (it takes its challenger out), or, if its
    process died, take its challenger out here."""
    from specserve import loop

    running = record.read()
    if running is None:
        print(f"no loop runs on {record.work_dir}")
        return 0
    if record.alive(running):
        if running["host"] != socket.gethostname():
            print(
                f"error: the loop runs on {running['host']} (pid {running['pid']}): abort it there",
                file=sys.stderr,
            )
            return 2
        os.kill(int(running["pid"]), signal.SIGTERM)
        deadline = time.monotonic() + 120
        while record.read() is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if record.read() is not None:
            print(f"error: pid {running['pid']} did not stop in 120 s", file=sys.stderr)
            return 1
        print(f"stopped the loop (pid {running['pid']}); it took its challenger out")
        return 0
    revision = loop.remove_left_behind(running, cli.open_store(args, check="the loop's abort"))
    record.finish(loop.ABORTED)
    if revision is None:
        print(f"the loop (pid {running['pid']}) had stopped; nothing of it serves")
    return 0


def _loop_undo(args: argparse.Namespace, record) -> int:  # noqa: ANN001
    """Return the live config to the revision from before the last loop, in one rollback."""
    last = record.read_last()
    if last is None or not last.get("revision_before"):
        print(f"error: no finished loop recorded in {record.work_dir}", file=sys.stderr)
        return 2
    args.config_command, args.to, args.keep = "rollback", last["revision_before"], None
    print(f"the loop of {last['incumbent']} ended: {last.get('outcome')}; rolling back")
    return cli.config_command(args)
