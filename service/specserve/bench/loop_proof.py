"""The closed loop on the embedded default, unattended: traffic of a domain the shipped drafters
never saw (`--domain`: drafter/domain.py, drafter/tickets.py) drives a running `specserve serve`
whose arms capture it; once `--capture` answers are kept, `specserve loop` adapts the
incumbent's drafter, adds it as a challenger arm, waits for the A/B verdict and promotes or
removes it, while the traffic goes on. Then the shipped and the promoted drafter are scored side
by side on the domain's held-out prompts (never sent; for the ticket domains, of templates and
packages never sent) and the original held-out sets, and acceptance over the run is plotted.

    SPECSERVE_CONFIG=capture.yaml make serve    # every arm with `capture: {sample: 1.0}`
    prometheus --config.file=prom.yml           # scraping :9464 every 5 s
    python -m specserve.bench.loop_proof --config capture.yaml \\
        --prometheus http://127.0.0.1:9090 --out proof/

While `adapt` trains, the traffic drops to `--adapt-concurrency` (on a 2-core machine the
trainer and the engines share the cores; on Kubernetes the job has pods of its own), and it
returns to `--concurrency` when the challenger is added. Writes `<out>/proof.json`,
`<out>/loop.log`, `<out>/acceptance.png` and prints a Markdown summary.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specserve.capture import store
from specserve.drafter.domain import extraction_requests
from specserve.drafter.tickets import ticket_requests
from specserve.headers import ARM
from specserve.metrics import SPEC_ACCEPTED_TOKENS, SPEC_DRAFTS

# --domain -> (its held-out set's name, requests(count, held_out=, seed=)).
DOMAINS: dict[str, tuple[str, Callable[..., list[list[dict]]]]] = {
    "extraction": ("extraction (held-out slot values)", extraction_requests),
    "tickets": ("tickets (held-out templates and packages)", ticket_requests),
    "tickets-long": (
        "long tickets (held-out templates and packages)",
        functools.partial(ticket_requests, long=True),
    ),
}
ORIGINAL_SETS = ("chat", "coding")
# Live acceptance length per arm, as the dashboards compute it (over a 2-minute window).
LIVE_ACCEPTANCE = (
    f"1 + sum by (arm) (rate(ray_{SPEC_ACCEPTED_TOKENS}_total[2m]))"
    f" / sum by (arm) (rate(ray_{SPEC_DRAFTS}_total[2m]))"
)


@dataclass(frozen=True)
class Sample:
    """One answered request: when it was sent, the arm that served it (the response's arm
    header) and its tokens/s as the router counts it (output tokens over the latency)."""

    started: float
    arm: str
    tokens_per_s: float


class Traffic:
    """Chat requests of a domain's training side, from `ceiling` threads of which
    only the first `concurrency` send (it can change while running); each request is a new
    user (the OpenAI `user` field), so the router splits by weight. Every answer is kept as a
    `Sample`."""

    def __init__(self, url: str, api_key: str, domain: str, max_tokens: int, ceiling: int) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=2)
        self.model = self.client.models.list().data[0].id
        self.max_tokens, self.concurrency = max_tokens, 0
        self.sent, self.failed = 0, 0
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._prompts = itertools.chain.from_iterable(
            DOMAINS[domain][1](500, seed=seed) for seed in itertools.count()
        )
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(ceiling)]

    def start(self, concurrency: int) -> None:
        self.concurrency = concurrency
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=600)

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            if index >= self.concurrency:
                time.sleep(0.5)
                continue
            with self._lock:
                messages = next(self._prompts)
            started = time.monotonic()
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model=self.model,
                    messages=messages,  # type: ignore[arg-type]  # plain {role, content} dicts
                    max_tokens=self.max_tokens,
                    temperature=0.0,
                    user=uuid.uuid4().hex,
                )
                usage = raw.parse().usage
                speed = (usage.completion_tokens if usage else 0) / (time.monotonic() - started)
                with self._lock:
                    self.samples.append(Sample(started, raw.headers.get(ARM, "?"), speed))
                    self.sent += 1
            except Exception as exc:  # counted and reported; the run goes on
                self.failed += 1
                print(f"traffic: a request failed: {exc}", file=sys.stderr)
                time.sleep(1)


def captured(directory: Path) -> int:
    return sum(1 for _ in store.read(directory))


def run_loop(args: argparse.Namespace, traffic: Traffic, log: Path) -> tuple[int, list[dict]]:
    """`specserve loop`, its output kept in `log`; -> exit code, [{at, line}] of its steps."""
    command = [sys.executable, "-m", "specserve.cli", "loop", "--incumbent", args.incumbent]
    command += ["--local", str(args.config), "--prometheus", args.prometheus]
    command += ["--captured", str(args.captured), "--work-dir", str(args.out / "work")]
    command += ["--updates", str(args.updates), "--workers", str(args.workers)]
    command += ["--share", str(args.share), "--poll-s", str(args.poll_s)]
    command += ["--min-requests", str(args.min_requests), "--max-wait-s", str(args.max_wait_s)]
    command += ["--json", str(args.out / "loop.json")]
    if args.replay_from:
        command += ["--replay-from", str(args.replay_from)]
    if args.challenger_cpus:
        command += ["--challenger-cpus", args.challenger_cpus]
    marks = []
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            out.flush()
            if line.startswith(("revision ", "[adapt ")) or "ACCEPTED" in line:
                marks.append({"at": time.time(), "line": line.strip()})
                print(line.rstrip(), flush=True)
            if line.startswith("revision ") and "added" in line:
                traffic.concurrency = args.concurrency  # the A/B runs at full load
            if line.startswith("outcome: "):
                # The loop is done: its process's exit must not wait behind the traffic (on
                # 2 cores it starved for 15 minutes with the traffic at full load).
                traffic.concurrency = 0
                marks.append({"at": time.time(), "line": line.strip()})
        return process.wait(), marks


def score(
    target: str, drafters: dict[str, str], domain: str, held_out: int, per_set: int, out: Path
):
    from specserve.drafter.evaluate import evaluate, write_report
    from specserve.drafter.pipeline import eval_sets

    name, requests = DOMAINS[domain]
    sets = {
        name: requests(held_out, held_out=True),
        **eval_sets(per_set, ORIGINAL_SETS),
    }
    # One thread and a 1 GiB KV cache: the serving engines still hold the rest of the machine.
    write_report(evaluate(target, drafters, sets, ks=(3,), max_tokens=128, threads=1), out)


def live_acceptance(prometheus: str, start: float, end: float) -> dict[str, list]:
    from specserve.ab.prometheus import Prometheus

    series = Prometheus(prometheus).matrix(LIVE_ACCEPTANCE, start, end, 15)
    return {labels["arm"]: sorted(points.items()) for labels, points in series if "arm" in labels}


def plot(report: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (live, offline) = plt.subplots(1, 2, figsize=(13, 4.5), width_ratios=(2, 1))
    start = report["started"]
    for arm, points in sorted(report["live_acceptance"].items()):
        if points:
            xs = [(t - start) / 60 for t, _ in points]
            live.plot(xs, [v for _, v in points], label=arm, lw=1.5)
    for mark in report["marks"]:
        if mark["line"].startswith("revision "):
            live.axvline((mark["at"] - start) / 60, color="grey", ls="--", lw=0.8)
            live.annotate(
                mark["line"].split(": ", 1)[-1][:40],
                ((mark["at"] - start) / 60, 1.02),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                rotation=15,
            )
    live.set(xlabel="minutes since the traffic began", ylabel="acceptance length (live, 2 m)")
    live.set_title("Live acceptance per arm across the loop's revisions", fontsize=10, pad=22)
    live.legend(fontsize=8)
    history = report["training"]
    lengths = [1 + sum(h["chain"]) for h in history]  # OfflineAcceptance's mean length
    offline.plot([h["update"] for h in history], lengths, marker="o")
    offline.set(xlabel="adapt: optimizer updates", ylabel="acceptance length (offline, k = 3)")
    offline.set_title("Validation on captured traffic while adapting", fontsize=10)
    fig.tight_layout()
    path = out / "acceptance.png"
    fig.savefig(path, dpi=120)
    return path


def markdown(report: dict[str, Any]) -> str:
    from specserve.drafter.evaluate import length_ratio

    rows = {(r["drafter"], r["prompt_set"]): r for r in report["scores"]}
    lines = [
        f"loop outcome: **{report['outcome']}** ({report['reason']})",
        f"traffic to verdict: {report['minutes']:.1f} min; {report['captured']} answers "
        f"captured before the loop; {report['sent']} requests sent, {report['failed']} failed",
        "",
        "| held-out set (k = 3) | shipped | adapted | ratio (95 % paired bootstrap) |",
        "| --- | --- | --- | --- |",
    ]
    for name in (DOMAINS[report["domain"]][0], *ORIGINAL_SETS):
        base, new = rows[("shipped", name)], rows[("adapted", name)]
        point, low, high = length_ratio(new, base)
        lines.append(
            f"| {name} ({base['prompts']}) | {base['mean_acceptance_length']:.3f} | "
            f"{new['mean_acceptance_length']:.3f} | {point:.3f}x ({low:.3f}-{high:.3f}) |"
        )
    if report.get("verdict"):
        v = report["verdict"]
        lines.append(f"\nlast A/B row: {v['verdict']}: {v['reason']}")
        lines.append(
            f"the challenger's requests left out of the A/B, their prompt trained on: "
            f"{v.get('left_out', 0):.0f}"
        )
    seen = report.get("seen_in_training") or {}
    if "sampled" in seen:
        lines.append(
            f"of {seen['sampled']} A/B prompts the incumbent captured, {seen['exact']:.1%} were "
            f"trained on exactly and {seen['near']:.1%} exactly or nearly"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from specserve.config.settings import get_settings
    from specserve.drafter.pipeline import _isolated
    from specserve.models import prepare_model, resolve_drafter_source

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="the file serve runs from")
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY", "none"))
    parser.add_argument("--captured", type=Path, help="default: the configured capture store")
    parser.add_argument("--incumbent", default="eagle3.1")
    parser.add_argument("--domain", choices=sorted(DOMAINS), default="extraction")
    parser.add_argument("--capture", type=int, default=600, help="answers before the loop")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--adapt-concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--share", type=float, default=0.5, help="of the incumbent's weight (0.5: equal load)"
    )
    parser.add_argument(
        "--challenger-cpus", help="the challenger's cores (default: the incumbent's), e.g. 1"
    )
    parser.add_argument("--poll-s", type=float, default=30)
    parser.add_argument("--min-requests", type=int, default=30)
    parser.add_argument("--max-wait-s", type=float, default=2400)
    parser.add_argument("--replay-from", type=Path, help="adapt: answers to replay (a build dir)")
    parser.add_argument("--held-out", type=int, default=64, help="domain prompts scored")
    parser.add_argument("--original-per-set", type=int, default=24)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    settings = get_settings()
    args.captured = args.captured or settings.capture_path()
    args.out.mkdir(parents=True, exist_ok=True)
    served = yaml.safe_load(args.config.read_text())
    arm = next((a for a in served["arms"] if a["name"] == args.incumbent), None)
    if arm is None or "model" not in arm.get("speculative", {}):
        parser.error(f"{args.config} has no EAGLE arm {args.incumbent!r}")
    shipped = resolve_drafter_source(arm["speculative"]["model"])

    started = time.time()
    traffic = Traffic(args.url, args.api_key, args.domain, args.max_tokens, args.concurrency)
    traffic.start(args.concurrency)
    try:
        while (kept := captured(args.captured)) < args.capture:
            print(f"captured {kept} of {args.capture} answers", flush=True)
            time.sleep(30)
        traffic.concurrency = args.adapt_concurrency
        code, marks = run_loop(args, traffic, args.out / "loop.log")
    finally:
        ended = time.time()
        traffic.stop()
    found = json.loads((args.out / "loop.json").read_text()) if code in (0, 3) else {}
    if not found:
        print(f"the loop ended with exit code {code}: see {args.out / 'loop.log'}")
        return 1
    adapt = json.loads((args.out / "work" / "adapt.json").read_text())
    scores = args.out / "scores.json"
    _isolated(
        score,
        str(prepare_model(served["model"]["source"])),
        {"shipped": shipped, "adapted": adapt["candidate"]},
        args.domain,
        args.held_out,
        args.original_per_set,
        scores,
    )
    report = {
        "domain": args.domain,
        "outcome": found["outcome"],
        "reason": found["reason"],
        "verdict": found["rows"][-1] if found["rows"] else None,
        "seen_in_training": found.get("seen_in_training"),
        "steps": found["steps"],
        "started": started,
        "minutes": (ended - started) / 60,
        "captured": kept,
        "sent": traffic.sent,
        "failed": traffic.failed,
        "adapt": {k: adapt[k] for k in ("name", "verdict", "data", "minutes")},
        "training": adapt["training"],
        "marks": marks,
        "scores": json.loads(scores.read_text()),
        "live_acceptance": live_acceptance(args.prometheus, started, time.time()),
    }
    (args.out / "proof.json").write_text(json.dumps(report, indent=1))
    print(f"plot: {plot(report, args.out)}")
    print(markdown(report))
    return 0 if found["outcome"] == "promoted" else 3


if __name__ == "__main__":
    raise SystemExit(main())
