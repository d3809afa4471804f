"""k by load: the number of draft tokens that pays at each batch size, derived from measurements.

A schedule is vLLM's `speculative_config.num_speculative_tokens_per_batch_size`: inclusive
batch-size ranges `(first, last, k)`, the first starting at 1, `k = 0` where drafting does not
pay. vLLM's scheduler looks up the k of each step by the number of requests in it and the
proposer drafts that many (with k = 0 nothing is proposed or verified; vLLM still runs an EAGLE
drafter's first pass to keep its KV cache in step, which specserve's CPU engines skip unless the
arm sets `skip_drafter_at_k0: false`).

What pays follows from two measurements:
- `RoundCosts`: milliseconds per engine step (a round: one target forward over every request in
  flight, one draft each and its verification) per batch size and k, measured on the arm's own
  engine settings (`specserve.bench.round_cost`);
- the acceptance at each draft position, live from Prometheus: `chain[p]`, the chance that the
  draft token at position p is accepted once drafted (every token before it accepted too).

A round at k then yields `1 + chain[0] + ... + chain[k-1]` tokens per request on average, and
each request gains that many tokens per round time: per-user tokens/s at batch size b is
`tokens(k) / cost(b, k)`. A measured step time moves by 10-50 % from one cell to the next on a
shared CPU core (machine C, docs/config.md "k by load"), enough to flip a cell's best k. So where
there are enough cells (`fit`), `derive` first fits the costs to how a round spends its time and
takes, at every batch size up to the largest measured, the k that maximises the fitted per-user
tokens/s; a larger k only where it gains more than PICK_MARGIN over the smaller. With too few
cells it takes each measured batch size's best k and spreads it to the sizes nearest it
(geometric midpoints between measured sizes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Range = tuple[int, int, int]  # (first batch size, last batch size, k), inclusive

# A larger k is chosen over a smaller one only where the fit says it gains more than this: the
# fit's own error is a few percent, and a k that only ties costs draft work for nothing.
PICK_MARGIN = 0.01
# Measured cells per coefficient of the fit needed before `derive` trusts it over the cells.
CELLS_PER_COEFFICIENT = 3
# A cell off the fit by more than this many times the kept cells' median error is left out of
# the next pass, for this many passes.
OUTLIER_FACTOR, OUTLIER_PASSES = 3.0, 3


def highest_k(num_speculative_tokens: int, schedule: Sequence[Sequence[int]] | None) -> int:
    """The most draft tokens an arm proposes in a round: its schedule's largest k (vLLM clamps
    each to `num_speculative_tokens`), else `num_speculative_tokens`; at least 1, so a drafter
    is scored even where the schedule turns drafting off everywhere."""
    if not schedule:
        return num_speculative_tokens
    return max(1, min(num_speculative_tokens, max(k for _, _, k in schedule)))


def problem(schedule: Sequence[Sequence[int]], max_k: int) -> str | None:
    """What is wrong with `schedule` for an arm with `num_speculative_tokens` = max_k, as
    vLLM's own validation would refuse it (and one thing it would silently clamp), or None."""
    if not schedule:
        return "must list at least one (first, last, k) range"
    last_end = 0
    for entry in schedule:
        if len(entry) != 3:
            return f"{list(entry)}: each range is [first batch size, last batch size, k]"
        first, last, k = entry
        if first < 1 or last < first:
            return f"{list(entry)}: batch sizes must be positive and first <= last"
        if first != last_end + 1:
            return (
                f"{list(entry)}: ranges must follow each other without gap or overlap, "
                f"the first starting at 1 (expected first = {last_end + 1})"
            )
        if not 0 <= k <= max_k:
            # vLLM clamps a larger k to num_speculative_tokens: say so instead of hiding it.
            return f"{list(entry)}: k must be between 0 and num_speculative_tokens ({max_k})"
        last_end = last
    return None


def k_at(schedule: Sequence[Sequence[int]], batch_size: int) -> int:
    """The k a schedule gives a batch size (the last range's beyond its end, as vLLM does)."""
    for first, last, k in schedule:
        if first <= batch_size <= last:
            return k
    return schedule[-1][2]


def describe(schedule: Sequence[Sequence[int]] | None, fixed_k: int | None = None) -> str:
    """`1-4: k=3, 5-16: k=1, 17+: k=0` (the last range open: vLLM carries its k on)."""
    if not schedule:
        return f"k={fixed_k}" if fixed_k is not None else "-"
    parts = []
    for i, (first, last, k) in enumerate(schedule):
        sizes = f"{first}+" if i == len(schedule) - 1 else f"{first}" if first == last else None
        parts.append(f"{sizes or f'{first}-{last}'}: k={k}")
    return ", ".join(parts)


def range_label(first: int, last: int, is_last: bool) -> str:
    """A range's label value in metrics (`1-4`, `17+`)."""
    return f"{first}+" if is_last else f"{first}-{last}"


def ranges_of(speculative: Any) -> list[tuple[str, int]]:
    """An arm's `speculative` section as (batch sizes label, k) pairs: its schedule's ranges,
    else `1+` with its fixed k (0 without speculation)."""
    schedule = getattr(speculative, "num_speculative_tokens_per_batch_size", None)
    if schedule:
        return [
            (range_label(first, last, i == len(schedule) - 1), k)
            for i, (first, last, k) in enumerate(schedule)
        ]
    return [("1+", int(getattr(speculative, "num_speculative_tokens", 0)))]


def expected_tokens(chain: Sequence[float], k: int) -> float:
    """Tokens a request gains in one round at k: the bonus token plus each accepted draft."""
    return 1.0 + sum(chain[:k])


@dataclass
class RoundCosts:
    """Median milliseconds per engine step, by batch size and k, of one arm's engine."""

    arm: str
    max_k: int
    ms: dict[int, dict[int, float]] = field(default_factory=dict)  # batch size -> k -> ms
    machine: str = ""
    measured_at: str = ""
    # Acceptance once drafted per position on the bench's own prompts at k = max_k: what
    # `specserve tune` falls back on for an arm without live traffic.
    bench_chain: list[float] = field(default_factory=list)
    # The cores the engine computed on while measured (its OpenMP threads, one per core).
    cores: list[int] = field(default_factory=list)

    def batch_sizes(self) -> list[int]:
        return sorted(self.ms)

    def where(self) -> str:
        """The machine and the engine's cores, as a report names them."""
        machine = self.machine or "this machine"
        if not self.cores:  # saved before the measuring engine was bound to the arm's cores
            return f"{machine}, cores unrecorded (maybe every core: measure again)"
        plural = "s" if len(self.cores) > 1 else ""
        return f"{machine}, the engine on core{plural} {','.join(map(str, self.cores))}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ms"] = {str(b): {str(k): v for k, v in ks.items()} for b, ks in self.ms.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundCosts:
        ms = {int(b): {int(k): float(v) for k, v in ks.items()} for b, ks in data["ms"].items()}
        return cls(
            data["arm"],
            int(data["max_k"]),
            ms,
            data.get("machine", ""),
            data.get("measured_at", ""),
            [float(x) for x in data.get("bench_chain", [])],
            [int(c) for c in data.get("cores", [])],
        )

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: Path) -> RoundCosts:
        return cls.from_json(json.loads(path.read_text()))


@dataclass
class Choice:
    """The best k at one measured batch size, and per-user tokens per second at every k."""

    batch_size: int
    k: int
    tokens_per_s: dict[int, float]

    def gain(self) -> float:
        """Per-user tokens/s at the chosen k over k = 0 (drafting nothing)."""
        return self.tokens_per_s[self.k] / self.tokens_per_s[0] if 0 in self.tokens_per_s else 1.0


def choices(costs: RoundCosts, chain: Sequence[float]) -> list[Choice]:
    """At each measured batch size, the k (up to what the chain and costs cover) with the most
    per-user tokens per second. Ties go to the smaller k (less work for the same speed)."""
    found = []
    for b in costs.batch_sizes():
        per_k = {
            k: 1000.0 * expected_tokens(chain, k) / ms
            for k, ms in sorted(costs.ms[b].items())
            if k <= len(chain) and ms > 0
        }
        if not per_k:
            continue
        best = max(per_k, key=lambda k: (round(per_k[k], 9), -k))
        found.append(Choice(b, best, per_k))
    return found


def round_terms(batch_size: int, k: int) -> list[float]:
    """What a round's time is spent on, one term per coefficient of `fit`: a fixed part, each
    token verified (b(k+1)) and its square (the cores filling up), each token drafted (bk), each
    drafter pass (k) and the speculative path itself (k > 0)."""
    verified = batch_size * (k + 1)
    return [1.0, verified, verified**2, batch_size * k, k, float(k > 0)]


@dataclass
class CostFit:
    """Least-squares coefficients of `round_terms` over an arm's measured cells."""

    coefficients: list[float]
    median_error: float  # the median of |fitted - measured| / measured over the cells

    def ms(self, batch_size: int, k: int) -> float:
        terms = round_terms(batch_size, k)
        return sum(c * t for c, t in zip(self.coefficients, terms, strict=True))


def fit(costs: RoundCosts) -> CostFit | None:
    """The costs fitted to `round_terms`, or None with fewer than CELLS_PER_COEFFICIENT cells per
    coefficient, under three batch sizes or two k's, or a fit that puts any round at or below
    zero milliseconds."""
    import numpy as np

    cells = [(b, k, ms) for b, by_k in costs.ms.items() for k, ms in by_k.items() if ms > 0]
    width = len(round_terms(1, 0))
    if (
        len(cells) < CELLS_PER_COEFFICIENT * width
        or len({b for b, _, _ in cells}) < 3
        or len({k for _, k, _ in cells}) < 2
    ):
        return None
    terms = np.array([round_terms(b, k) for b, k, _ in cells])
    measured = np.array([ms for _, _, ms in cells])
    # Least squares, refitted without the cells far off the fit (a burst of slow steps pulls a
    # plain fit towards it); those cells still count in the reported error.
    kept = np.ones(len(cells), dtype=bool)
    for _ in range(OUTLIER_PASSES):
        coefficients = np.linalg.lstsq(terms[kept], measured[kept], rcond=None)[0]
        error = np.abs(terms @ coefficients - measured) / measured
        kept = error <= OUTLIER_FACTOR * max(float(np.median(error[kept])), 0.01)
    max_k = max(k for _, k, _ in cells)
    grid = np.array(
        [round_terms(b, k) for b in range(1, max(costs.ms) + 1) for k in range(max_k + 1)]
    )
    if (grid @ coefficients).min() <= 0:
        return None
    # `error` is the last pass's, over every cell: the final coefficients'.
    return CostFit([float(c) for c in coefficients], float(np.median(error)))


def derive(costs: RoundCosts, chain: Sequence[float]) -> list[Range]:
    """The schedule (`derive_with_fit`'s)."""
    return derive_with_fit(costs, chain)[0]


def derive_with_fit(
    costs: RoundCosts, chain: Sequence[float]
) -> tuple[list[Range], CostFit | None]:
    """The schedule and the fit it came from: from the fitted costs where `fit` gives them
    (each batch size's best k, a larger k only past PICK_MARGIN), else (fit None) each measured
    batch size's best k over the sizes nearer to it than to its measured neighbours (split at
    their geometric mean); the last range ends at the largest measured size (vLLM carries its k
    on beyond), and neighbouring ranges with the same k are merged."""
    fitted = fit(costs)
    if fitted is not None:
        return _derive_from_fit(fitted, costs, chain), fitted
    picked = choices(costs, chain)
    max_batch = max(costs.batch_sizes(), default=1)
    if not picked:
        raise ValueError(f"{costs.arm}: no round costs to derive a schedule from")
    ranges: list[Range] = []
    first = 1
    for i, choice in enumerate(picked):
        if i + 1 < len(picked):
            split = math.floor(math.sqrt(choice.batch_size * picked[i + 1].batch_size))
            last = min(max(split, choice.batch_size, first), max_batch)
        else:
            last = max_batch
        if first > max_batch:
            break
        if ranges and ranges[-1][2] == choice.k:
            ranges[-1] = (ranges[-1][0], last, choice.k)
        else:
            ranges.append((first, last, choice.k))
        first = last + 1
    return ranges, None


def _derive_from_fit(fitted: CostFit, costs: RoundCosts, chain: Sequence[float]) -> list[Range]:
    max_k = min(len(chain), max(k for by_k in costs.ms.values() for k in by_k))
    ranges: list[Range] = []
    for b in range(1, max(costs.ms) + 1):
        best_k, best = 0, 1.0 / fitted.ms(b, 0)
        for k in range(1, max_k + 1):
            tokens_per_ms = expected_tokens(chain, k) / fitted.ms(b, k)
            if tokens_per_ms > best * (1 + PICK_MARGIN):
                best_k, best = k, tokens_per_ms
        if ranges and ranges[-1][2] == best_k:
            ranges[-1] = (ranges[-1][0], b, best_k)
        else:
            ranges.append((b, b, best_k))
    return ranges


def chain_from_counts(accepted: Sequence[float], drafted: Sequence[float]) -> list[float]:
    """Acceptance per position from counters: accepted tokens at position p over draft tokens
    proposed at p (0 where none were proposed)."""
    padded = list(accepted) + [0.0] * max(0, len(drafted) - len(accepted))
    return [a / d if d > 0 else 0.0 for a, d in zip(padded, drafted, strict=False)]
