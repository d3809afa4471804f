"""`specserve bench`: per-arm serving speed side by side, on vLLM's own serving benchmark.

For each concurrency level, the prompts are cut into rounds; in every round each arm (forced with
the override header, in a rotating order) serves the same prompts through
`vllm.benchmarks.serve.benchmark` — vLLM's request functions and metrics, streaming, greedy — so
every ratio compares arms on the same prompts under the same machine state. Warm-up requests are
excluded. Acceptance comes from specserve's per-arm counters on the metrics endpoint, read at
each level's start and end. Speedup is the ratio of mean per-user output tokens/s against the
baseline arm, with a paired bootstrap confidence interval over rounds, then the prompts within
them: a round's requests share its start and the machine's state, so they vary together.
With `--together` the arms serve each round at the same time instead, as under a live split,
so the engines that share a core compete for it, each with the same load throughout
(bench/together.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from specserve import headers
from specserve.bootstrap import paired_interval
from specserve.config.settings import get_settings
from specserve.metrics import (
    ARM,
    EXPORT_PREFIX,
    OUTPUT_TOKENS,
    POSITION,
    SPEC_ACCEPTED_PER_POSITION,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
    scrape,
)

# Where OpenAI's clients, and vLLM's serving benchmark, read the API key from.
API_KEY_ENV = "OPENAI_API_KEY"

PROMPT_SETS = ("chat", "coding", "long", "perturbed")
_KIND_OF_SET = {"chat": "chat", "coding": "code", "long": "long", "perturbed": "perturbed"}
# Ray exports recorded metrics in batches (every 2 s for a local `specserve serve`).
METRICS_SETTLE_S = 5.0


@dataclass
class Cell:
    """One arm at one concurrency level: per-request figures in prompt order."""

    arm: str
    concurrency: int
    # Per user: output tokens / latency; NaN where the request failed, so that the lists of
    # every arm stay aligned prompt by prompt.
    tokens_per_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    failed: int = 0
    # (start, end) of each of the arm's blocks, seconds on the monotonic clock: shows whether
    # arms served in turn or at the same time.
    windows: list[tuple[float, float]] = field(default_factory=list)
    # Prompts in each round, in order: a round's requests share its start (a burst of
    # `concurrency` at once) and whatever the machine did meanwhile, so they vary together.
    round_sizes: list[int] = field(default_factory=list)
    acceptance: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        tps = np.array(self.tokens_per_s)
        tps = tps[~np.isnan(tps)]
        return {
            "arm": self.arm,
            "concurrency": self.concurrency,
            "requests": len(tps),
            "failed": self.failed,
            "tokens_per_s_mean": float(tps.mean()) if len(tps) else math.nan,
            "tokens_per_s_p50": float(np.median(tps)) if len(tps) else math.nan,
            "ttft_ms_p50": _ms_median(self.ttft_s),
            "tpot_ms_p50": _ms_median(self.tpot_s),
            "latency_ms_p50": _ms_median(self.latency_s),
            **self.acceptance,
        }


def _ms_median(values: list[float]) -> float:
    return float(np.median(values)) * 1000 if values else math.nan


def load_prompts(source: str, limit: int) -> list[list[dict]]:
    """Chat messages: a built-in held-out set (never trained on), or a JSONL file with one
    `{"messages": [...]}` or `{"prompt": "..."}` per line."""
    if source in PROMPT_SETS:
        from specserve.drafter.prompts import build_prompts, first_turn

        kind = _KIND_OF_SET[source]
        # A multi-turn prompt's assistant turns are filled in by training; here: first turn.
        chats = [first_turn(p.messages) for p in build_prompts(held_out=True) if p.kind == kind]
    else:
        chats = []
        for line in Path(source).read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                chats.append(item.get("messages") or [{"role": "user", "content": item["prompt"]}])
    if not chats:
        raise SystemExit(f"no prompts in {source!r}")
    return chats[:limit]


def discover(url: str) -> tuple[str, list[str]]:
    """The served model and the configured arms, from the router's OpenAPI document."""
    key = os.environ.get(API_KEY_ENV)
    auth = {headers.AUTHORIZATION: f"Bearer {key}"} if key else {}
    try:
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=30)
        if models.status_code in (401, 403):
            raise SystemExit(
                f"{url} wants an API key: set {API_KEY_ENV} to an admin key (the benchmark "
                "forces each arm in turn, which needs one)"
            )
        if models.status_code != 200:
            raise SystemExit(
                f"{url}/v1/models answered {models.status_code} (is the platform still "
                f"starting?): {models.text[:200]}"
            )
        model = models.json()["data"][0]["id"]
        doc = httpx.get(f"{url}/openapi.json", timeout=30).json()
        chat = doc["paths"]["/v1/chat/completions"]["post"]
        arm_header = next(p for p in chat["parameters"] if p["name"] == headers.ARM_OVERRIDE)
    except httpx.HTTPError as exc:
        raise SystemExit(
            f"cannot reach specserve at {url} ({exc}): start it with `specserve serve`, or "
            "pass --url"
        ) from None
    except (ValueError, LookupError, StopIteration, TypeError):
        raise SystemExit(
            f"{url} does not describe specserve's arms (no {headers.ARM_OVERRIDE} header in its "
            "/openapi.json): --url names specserve's router"
        ) from None
    return model, list(arm_header["schema"]["enum"])


def read_acceptance(metrics_url: str | None) -> dict[str, dict[str, float]]:
    """Per arm: verify steps, draft and accepted tokens, accepted tokens per draft position and
    output tokens."""
    if metrics_url is None:
        return {}
    wanted = {
        EXPORT_PREFIX + SPEC_DRAFTS + "_total": "drafts",
        EXPORT_PREFIX + SPEC_DRAFT_TOKENS + "_total": "draft_tokens",
        EXPORT_PREFIX + OUTPUT_TOKENS + "_total": "output_tokens",
        EXPORT_PREFIX + SPEC_ACCEPTED_TOKENS + "_total": "accepted",
        EXPORT_PREFIX + SPEC_ACCEPTED_PER_POSITION + "_total": "position",
    }
    out: dict[str, dict[str, float]] = {}
    for _, s in scrape(metrics_url):
        name = wanted.get(s.name)
        if name is None or ARM not in s.labels:
            continue
        key = f"position_{s.labels[POSITION]}" if name == "position" else name
        arm = out.setdefault(s.labels[ARM], {})
        arm[key] = arm.get(key, 0.0) + s.value
    return out


def acceptance_between(before: dict, after: dict, arm: str) -> dict[str, Any]:
    a, b = after.get(arm, {}), before.get(arm, {})
    drafts = a.get("drafts", 0.0) - b.get("drafts", 0.0)
    accepted = a.get("accepted", 0.0) - b.get("accepted", 0.0)
    # Every engine step of a request yields one token plus the drafts it accepted; steps at
    # k = 0 (a k schedule under load) draft nothing. Draft tokens per step: the k in force.
    steps = a.get("output_tokens", 0.0) - b.get("output_tokens", 0.0) - accepted
    draft_tokens = a.get("draft_tokens", 0.0) - b.get("draft_tokens", 0.0)
    found: dict[str, Any] = {"k_in_force": draft_tokens / steps} if steps > 0 else {}
    if drafts <= 0:
        return found
    positions = sorted(k for k in a if k.startswith("position_"))
    return found | {
        "mean_acceptance_length": 1 + accepted / drafts,
        "accepted_per_position": [
            (a[k] - b.get(k, 0.0)) / drafts for k in sorted(positions, key=lambda k: int(k[9:]))
        ],
    }


async def _run_block(url, model, arm, chats, concurrency, max_tokens, warmups) -> list:
    """One arm serving `chats` at `concurrency` through vLLM's serving benchmark."""
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark

    requests = [
        SampleRequest(prompt="", prompt_len=0, expected_output_len=max_tokens, chat_messages=m)
        for m in chats
    ]
    result = await benchmark(
        task_type=TaskType.GENERATION,
        endpoint_type="openai-chat",
        api_url=f"{url}/v1/chat/completions",
        base_url=url,
        model_id=model,
        model_name=model,
        tokenizer=None,
        input_requests=requests,
        logprobs=None,
        request_rate=float("inf"),
        burstiness=1.0,
        disable_tqdm=True,
        num_warmups=warmups,
        profile=False,
        selected_percentile_metrics=["ttft", "tpot", "e2el"],
        selected_percentiles=[50.0],
        ignore_eos=False,
        goodput_config_dict={},
        max_concurrency=concurrency,
        lora_modules=None,
        extra_headers={headers.ARM_OVERRIDE: arm},
        extra_body={"temperature": 0.0},
        ready_check_timeout_sec=0,
    )
    return list(
        zip(
            result["output_lens"],
            result["ttfts"],
            result["latencies"],
            result["errors"],
            strict=True,
        )
    )


async def _timed(block) -> tuple[list, tuple[float, float]]:
    start = time.monotonic()
    rows = await block
    return rows, (start, time.monotonic())


async def _run_blocks(args, model, arms, chats, concurrency) -> list:
    """Each arm's block with its time window, one after the other, or all at once with
    `--together` (bench/together.py)."""
    if args.together:
        from specserve.bench.together import run_together  # imports vLLM's benchmark client

        return await run_together(
            args.url, model, arms, chats, concurrency, args.max_tokens, args.warmups
        )
    # vLLM's benchmark prints its own report; the per-request figures are what is kept.
    with contextlib.redirect_stdout(io.StringIO()):
        return [
            await _timed(
                _run_block(args.url, model, arm, chats, concurrency, args.max_tokens, args.warmups)
            )
            for arm in arms
        ]


def split_rounds(chats: list, rounds: int, concurrency: int) -> list[list]:
    """The prompts cut into rounds, fewer where needed so that every round holds at least
    `concurrency` prompts: a level is only measured at its concurrency if that many requests
    can be in flight at once."""
    if len(chats) < concurrency:
        print(f"only {len(chats)} prompts: concurrency {concurrency} runs {len(chats)} at once")
    n = max(1, min(rounds, len(chats) // concurrency))
    return [chats[i::n] for i in range(n)]


def measure_level(args, model, arms, chats, concurrency) -> dict[str, Cell]:
    cells = {arm: Cell(arm, concurrency) for arm in arms}
    rounds = split_rounds(chats, args.rounds, concurrency)
    before = read_acceptance(args.metrics_url)
    progress = tqdm(total=len(chats) * len(arms), desc=f"concurrency {concurrency}")
    for r, prompts in enumerate(rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        blocks = asyncio.run(_run_blocks(args, model, order, prompts, concurrency))
        for arm, (rows, window) in zip(order, blocks, strict=True):
            cell = cells[arm]
            cell.windows.append(window)
            cell.round_sizes.append(len(rows))
            for tokens, ttft, latency, error in rows:
                if error or not tokens:
                    cell.failed += 1
                    cell.tokens_per_s.append(math.nan)
                    continue
                cell.tokens_per_s.append(tokens / latency)
                cell.ttft_s.append(ttft)
                cell.latency_s.append(latency)
                if tokens > 1:
                    cell.tpot_s.append((latency - ttft) / (tokens - 1))
            progress.update(len(prompts))
    progress.close()
    if args.metrics_url:
        time.sleep(METRICS_SETTLE_S)
    after = read_acceptance(args.metrics_url)
    for arm, cell in cells.items():
        cell.acceptance = acceptance_between(before, after, arm)
    return cells


def speedup_ci(
    arm: list[float], base: list[float], round_sizes: list[int] | None = None, seed: int = 0
) -> tuple[float, float, float]:
    """Ratio of mean per-user tokens/s, arm over baseline, and its paired bootstrap CI (prompts
    either arm lacks are left out): over rounds, then prompts within them, where the figures
    come in rounds of `round_sizes` prompts (bootstrap.py), else over prompts."""
    pairs = _pairs(arm, base)
    rounds = None
    if round_sizes is not None and sum(round_sizes) == len(arm):
        labels = np.repeat(np.arange(len(round_sizes)), round_sizes)
        rounds = labels[_kept(arm, base)]
    return paired_interval(
        lambda s: s[..., 0].mean(-1) / s[..., 1].mean(-1), pairs, groups=rounds, seed=seed
    )


def _pairs(arm: list[float], base: list[float]) -> np.ndarray:
    """(prompts, 2) of the two arms' figures, prompts either arm lacks (NaN) left out."""
    return np.array([arm, base], dtype=float).T.reshape(-1, 2)[_kept(arm, base)]


def _kept(arm: list[float], base: list[float]) -> np.ndarray:
    """Which prompts both arms have figures for."""
    return ~np.isnan(np.array([arm, base], dtype=float).T.reshape(-1, 2)).any(axis=1)


def speedup_by_round(arm: Cell, base: Cell) -> list[float]:
    """The ratio of mean per-user tokens/s in each round: the spread between rounds shows how
    much one run's ratio can move, which an interval over prompts does not."""
    ends = np.cumsum(base.round_sizes)
    ratios = []
    for start, end in zip(ends - base.round_sizes, ends, strict=True):
        pairs = _pairs(arm.tokens_per_s[start:end], base.tokens_per_s[start:end])
        ratios.append(float(pairs[:, 0].mean() / pairs[:, 1].mean()) if len(pairs) else math.nan)
    return ratios


def summarize(levels: dict[int, dict[str, Cell]], baseline: str) -> list[dict[str, Any]]:
    rows = []
    for cells in levels.values():
        base = cells.get(baseline)
        for cell in cells.values():
            row = cell.summary()
            if base is not None:
                same_rounds = cell.round_sizes == base.round_sizes
                ratio, low, high = speedup_ci(
                    cell.tokens_per_s, base.tokens_per_s, base.round_sizes if same_rounds else None
                )
                row |= {"speedup": ratio, "speedup_low": low, "speedup_high": high}
                if same_rounds:
                    row["speedup_rounds"] = speedup_by_round(cell, base)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], baseline: str) -> str:
    lines = [
        f"| arm | users | tok/s per user (mean / p50) "
        f"| speedup vs {baseline} (95% CI over rounds) | rounds' speedups (lowest-highest) "
        "| TTFT p50 | TPOT p50 | latency p50 | acceptance length | k in force | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        speedup = (
            f"{r['speedup']:.2f}x ({r['speedup_low']:.2f}-{r['speedup_high']:.2f})"
            if not math.isnan(r.get("speedup", math.nan))
            else "-"
        )
        by_round = [x for x in r.get("speedup_rounds", []) if not math.isnan(x)]
        rounds = f"{min(by_round):.2f}-{max(by_round):.2f}" if len(by_round) > 1 else "-"
        acc = r.get("mean_acceptance_length")
        k = r.get("k_in_force", math.nan)
        lines.append(
            f"| {r['arm']} | {r['concurrency']} | {r['tokens_per_s_mean']:.1f} / "
            f"{r['tokens_per_s_p50']:.1f} | {speedup} | {rounds} | {r['ttft_ms_p50']:.0f} ms "
            f"| {r['tpot_ms_p50']:.1f} ms | {r['latency_ms_p50']:.0f} ms "
            f"| {f'{acc:.2f}' if acc else '-'} | {'-' if math.isnan(k) else f'{k:.2f}'} "
            f"| {r['failed']} |"
        )
    return "\n".join(lines)


def compare(rows: list[dict[str, Any]], earlier: dict[str, Any]) -> str:
    """What changed per arm and level since an earlier run's JSON."""
    old = {(r["arm"], r["concurrency"]): r for r in earlier["rows"]}
    lines = [
        "| arm | users | tok/s per user now (then) | change | speedup now (then) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        was = old.get((r["arm"], r["concurrency"]))
        if was is None:
            lines.append(
                f"| {r['arm']} | {r['concurrency']} | {r['tokens_per_s_mean']:.1f} (new) | - | - |"
            )
            continue
        change = r["tokens_per_s_mean"] / was["tokens_per_s_mean"] - 1
        lines.append(
            f"| {r['arm']} | {r['concurrency']} | {r['tokens_per_s_mean']:.1f} "
            f"({was['tokens_per_s_mean']:.1f}) | {change:+.1%} "
            f"| {r.get('speedup', math.nan):.2f}x ({was.get('speedup', math.nan):.2f}x) |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], baseline: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    arms = sorted({r["arm"] for r in rows if r["arm"] != baseline})
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in arms:
        mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["concurrency"])
        x = [r["concurrency"] for r in mine]
        y = np.array([r.get("speedup", math.nan) for r in mine])
        low = y - np.array([r.get("speedup_low", math.nan) for r in mine])
        high = np.array([r.get("speedup_high", math.nan) for r in mine]) - y
        ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=4, label=arm)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent users")
    ax.set_ylabel(f"per-user tokens/s vs {baseline}")
    ax.set_title("Speedup (95% bootstrap CI)")
    paths.append(_save(fig, ax, out / "speedup.png"))

    with_positions = [r for r in rows if r.get("accepted_per_position")]
    if with_positions:
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in sorted({r["arm"] for r in with_positions}):
            # The lowest concurrency's run: acceptance does not depend on load.
            r = min((r for r in with_positions if r["arm"] == arm), key=lambda r: r["concurrency"])
            per_position = r["accepted_per_position"]
            ax.plot(range(1, len(per_position) + 1), per_position, marker="o", label=arm)
        ax.set_xticks(range(1, max(len(r["accepted_per_position"]) for r in with_positions) + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted per verify step")
        ax.set_ylim(0, 1)
        ax.set_title("Acceptance by draft position")
        paths.append(_save(fig, ax, out / "acceptance_by_position.png"))
    return paths


def _save(fig, ax, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="OpenAI-compatible base")
    parser.add_argument(
        "--api-key",
        help=f"an admin key of the deployment (default: ${API_KEY_ENV}); each arm is forced",
    )
    parser.add_argument("--arms", nargs="*", help="default: every configured arm")
    parser.add_argument("--baseline", default="no-spec", help="the arm speedups are against")
    parser.add_argument(
        "--prompts", default="chat", help=f"{' | '.join(PROMPT_SETS)} or a JSONL file"
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="arms take turns this many times")
    parser.add_argument(
        "--together",
        action="store_true",
        help="every arm serves its block at the same time, as under a live split, instead of "
        "each in turn alone on the machine; each with the same load until the last arm is done",
    )
    parser.add_argument("--warmups", type=int, default=2, help="requests per block, not counted")
    parser.add_argument(
        "--metrics-url",
        help="specserve's metrics endpoint, for acceptance (default: this machine's "
        "SPECSERVE_METRICS_PORT; '' to skip)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--compare", type=Path, help="an earlier run's results.json")


def run(args: argparse.Namespace) -> int:
    args.url = args.url.rstrip("/")
    if args.api_key:  # vLLM's request functions read it from there
        os.environ[API_KEY_ENV] = args.api_key
    if args.metrics_url is None:
        args.metrics_url = f"http://127.0.0.1:{get_settings().metrics_port}/metrics"
    args.metrics_url = args.metrics_url or None
    model, configured = discover(args.url)
    arms = args.arms or configured
    unknown = sorted(set(arms) - set(configured))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; configured: {configured}")
    if args.baseline not in arms:
        raise SystemExit(f"baseline {args.baseline!r} is not among the arms {arms}")
    if args.metrics_url:
        try:
            read_acceptance(args.metrics_url)
        except httpx.HTTPError as exc:
            print(f"metrics endpoint unreachable ({exc}); acceptance is left out")
            args.metrics_url = None
    chats = load_prompts(args.prompts, args.num_prompts)
    print(
        f"{model}: arms {arms}, {len(chats)} {args.prompts} prompts per level, "
        f"concurrency {args.concurrency}, {args.max_tokens} tokens at most, greedy, "
        + ("arms at the same time" if args.together else "arms in turn")
    )
    levels = {c: measure_level(args, model, arms, chats, c) for c in args.concurrency}
    rows = summarize(levels, args.baseline)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "model": model,
        "url": args.url,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "together": args.together,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rows": rows,
        "requests": {
            f"{c}/{arm}": asdict(cell) for c, cells in levels.items() for arm, cell in cells.items()
        },
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown(rows, args.baseline)
    (args.out / "results.md").write_text(table + "\n")
    print(table)
    if args.compare:
        print(f"\nsince {args.compare}:\n" + compare(rows, json.loads(args.compare.read_text())))
    for path in plot(rows, args.baseline, args.out):
        print(f"wrote {path}")
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
