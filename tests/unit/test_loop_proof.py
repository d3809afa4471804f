"""The loop proof's summary and plot (bench/loop_proof.py), from a report of the shape a run
writes; the run itself is measured in BENCHMARKS.md."""

from __future__ import annotations

import pytest

from specserve.bench.loop_proof import DOMAINS, ORIGINAL_SETS, markdown, plot

DOMAIN = "tickets"
HELD_OUT_SET = DOMAINS[DOMAIN][0]


def row(drafter: str, prompt_set: str, accepted: list[int]) -> dict:
    """An evaluate() row at k = 3 over len(accepted) prompts of 10 drafts each."""
    per_prompt = [[10, a] for a in accepted]
    drafts, total = 10 * len(accepted), sum(accepted)
    return {
        "drafter": drafter,
        "k": 3,
        "prompt_set": prompt_set,
        "prompts": len(accepted),
        "drafts": drafts,
        "accepted": total,
        "mean_acceptance_length": 1 + total / drafts,
        "per_prompt": per_prompt,
    }


def report() -> dict:
    scores = [row("shipped", HELD_OUT_SET, [4, 5, 3, 4]), row("adapted", HELD_OUT_SET, [9] * 4)]
    for name in ORIGINAL_SETS:
        scores += [row("shipped", name, [8, 8, 7, 9]), row("adapted", name, [8, 7, 7, 9])]
    return {
        "domain": DOMAIN,
        "outcome": "promoted",
        "reason": "faster: +12.0 %",
        "verdict": {"verdict": "promote", "reason": "faster: +12.0 %", "left_out": 37.0},
        "seen_in_training": {"sampled": 200, "exact": 0.05, "near": 0.125},
        "started": 1000.0,
        "minutes": 41.5,
        "captured": 600,
        "sent": 2500,
        "failed": 0,
        "marks": [{"at": 1600.0, "line": "revision r2: challenger eagle3.1-abc added"}],
        "training": [
            {"update": 0, "chain": [0.3, 0.1, 0.0]},
            {"update": 25, "chain": [0.6, 0.4, 0.3]},
        ],
        "scores": scores,
        "live_acceptance": {"eagle3.1": [(1000.0, 1.4), (1900.0, 1.5)], "ngram": []},
    }


def test_the_summary_gives_each_set_its_lengths_and_paired_ratio():
    text = markdown(report())
    assert "**promoted**" in text and "41.5 min" in text and "600 answers" in text
    held_out = next(line for line in text.splitlines() if line.startswith(f"| {HELD_OUT_SET}"))
    # shipped 1 + 16/40 = 1.4, adapted 1 + 36/40 = 1.9: 1.357x
    assert "| 1.400 | 1.900 | 1.357x (" in held_out
    chat = next(line for line in text.splitlines() if line.startswith("| chat"))
    assert "| 1.800 | 1.775 | 0.986x (" in chat


def test_the_summary_says_how_much_of_the_ab_was_trained_on():
    text = markdown(report())
    assert "left out of the A/B, their prompt trained on: 37" in text
    assert "of 200 A/B prompts" in text and "5.0% were trained on exactly" in text
    assert "12.5% exactly or nearly" in text


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_every_domain_draws_distinct_requests_from_each_side(domain):
    requests = DOMAINS[domain][1]
    train, held_out = requests(20, seed=1), requests(20, held_out=True, seed=1)
    texts = [m[-1]["content"] for m in train + held_out]
    assert len(set(texts)) == 40


def test_the_plot_is_written(tmp_path):
    path = plot(report(), tmp_path)
    assert path.exists() and path.read_bytes()[:4] == b"\x89PNG"
