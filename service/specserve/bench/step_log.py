"""Each served arm's engine steps, from vLLM's own per-step log.

    python -m specserve.bench.step_log [--logs /tmp/ray/session_latest/logs] [--from-requests 9]

An arm whose `engine` sets `enable_logging_iteration_details: true` logs one line per engine
step: how many requests and tokens it prefilled ("context") and decoded ("generation"), and how
long the step took. Ray writes each serve replica's output to a worker log named by its process
id, whose header names the replica's actor (`ServeReplica:arm-NAME:...`). This reads those logs
and summarises each arm's steps:

- decode-only steps by (requests, tokens per request): a step at k verifies k drafts per
  request, so it decodes 1 + k tokens each; the median step time of each, what a served round
  costs (on a core shared with another engine, a step's wall time includes the other's turns);
- steps with a prefill: how many, their time and context tokens.

`--from-requests N` starts each arm's summary at its first step with N or more requests (the
first step of a load level). The per-step timestamps of vLLM's lines have whole seconds only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LOGS = Path("/tmp/ray/session_latest/logs")
ACTOR = re.compile(r"^:actor_name:ServeReplica:arm-([^:\s]+):")
STEP = re.compile(
    r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, "
    r"(\d+) generation requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms"
)


@dataclass(frozen=True)
class Step:
    context_requests: int
    context_tokens: int
    decode_requests: int
    decode_tokens: int
    ms: float

    @property
    def requests(self) -> int:
        return self.context_requests + self.decode_requests


def read_steps(lines: Iterable[str]) -> tuple[str | None, list[Step]]:
    """The arm a worker log belongs to (None: not an arm's replica) and its steps in order."""
    arm, steps = None, []
    for line in lines:
        if arm is None and (actor := ACTOR.match(line)):
            arm = actor.group(1)
        if match := STEP.search(line):
            _, cr, ct, gr, gt, ms = match.groups()
            steps.append(Step(int(cr), int(ct), int(gr), int(gt), float(ms)))
    return arm, steps


def arm_steps(logs: Path) -> dict[str, list[Step]]:
    """Every arm's steps, from the worker logs under `logs` (replicas of an arm one after the
    other)."""
    arms: dict[str, list[Step]] = defaultdict(list)
    for path in sorted(logs.glob("worker-*.out")):
        with path.open(errors="replace") as lines:
            arm, steps = read_steps(lines)
        if arm is not None and steps:
            arms[arm].extend(steps)
    return dict(arms)


def summarise(steps: list[Step], from_requests: int = 0) -> dict:
    """One arm's steps from its first with `from_requests` or more requests."""
    start = next((i for i, s in enumerate(steps) if s.requests >= from_requests), len(steps))
    steps = steps[start:]
    decode: dict[tuple[int, int], list[float]] = defaultdict(list)
    for s in steps:
        if s.context_requests == 0 and s.decode_requests:
            decode[(s.decode_requests, s.decode_tokens // s.decode_requests)].append(s.ms)
    prefill = [s for s in steps if s.context_requests]
    return {
        "steps": len(steps),
        "seconds": sum(s.ms for s in steps) / 1000,
        "decode": [
            {
                "requests": r,
                "tokens_per_request": t,
                "steps": len(ms),
                "median_ms": statistics.median(ms),
            }
            for (r, t), ms in sorted(decode.items())
        ],
        "prefill_steps": len(prefill),
        "prefill_seconds": sum(s.ms for s in prefill) / 1000,
        "context_tokens": sum(s.context_tokens for s in prefill),
    }


def render(summaries: dict[str, dict], min_steps: int) -> str:
    lines = [
        "| arm | steps | seconds | steps with a prefill (s, context tokens) | decode-only steps: "
        "requests x tokens each: median ms (steps) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for arm, s in summaries.items():
        decode = ", ".join(
            f"{d['requests']}x{d['tokens_per_request']}: {d['median_ms']:.1f} ({d['steps']})"
            for d in s["decode"]
            if d["steps"] >= min_steps
        )
        lines.append(
            f"| {arm} | {s['steps']} | {s['seconds']:.1f} | {s['prefill_steps']} "
            f"({s['prefill_seconds']:.1f} s, {s['context_tokens']}) | {decode or '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", type=Path, default=LOGS, help="Ray's session log directory")
    parser.add_argument(
        "--from-requests", type=int, default=0, help="start at each arm's first step this full"
    )
    parser.add_argument(
        "--min-steps", type=int, default=20, help="show decode shapes with this many steps"
    )
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args(argv)
    arms = arm_steps(args.logs)
    if not arms:
        print(
            f"no engine step lines under {args.logs}: set `enable_logging_iteration_details: "
            "true` in the arms' `engine` (docs/config.md)",
            file=sys.stderr,
        )
        return 1
    summaries = {arm: summarise(steps, args.from_requests) for arm, steps in sorted(arms.items())}
    print(render(summaries, args.min_steps))
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
