"""How much of the traffic a loop's A/B judged its candidate on was in the candidate's training
data.

A candidate adapted on captured traffic is then compared on live traffic, which may repeat what
it learned (a client cycling through the same prompts, or a template with one slot changed): a
faster challenger on such traffic has memorised as much as it has adapted. The incumbent keeps its
capture sample during the A/B, and the router randomises requests between the two arms, so the
share of that sample whose prompt was trained on estimates the share of the challenger's traffic
too. Exact repeats are prompts with the same token ids; near ones overlap a training prompt's
token 4-grams by curation.NEAR_DUPLICATE_JACCARD or more.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from specserve.capture.store import Record
from specserve.drafter.curation import NearDuplicates


def seen_in_training(
    training: Iterable[list[int]], served: Iterable[list[int]]
) -> dict[str, float | int]:
    """-> {sampled, exact, near}: the served prompts, and the shares of them that repeat a
    training prompt exactly, and exactly or nearly (near includes exact)."""
    exact: set[tuple[int, ...]] = set()
    index = NearDuplicates()
    for prompt in training:
        if tuple(prompt) not in exact:
            exact.add(tuple(prompt))
            index.add(prompt)
    sampled = same = near = 0
    for prompt in served:
        sampled += 1
        if tuple(prompt) in exact:
            same += 1
            near += 1
        elif index.matches(prompt):
            near += 1
    return {
        "sampled": sampled,
        "exact": same / sampled if sampled else float("nan"),
        "near": near / sampled if sampled else float("nan"),
    }


def _trained_on(
    records: Iterable[Record],
    trained_arm: str | None,
    since: float,
    held_out: float,
    validation: float,
) -> list[Record]:
    """Of `records`, those captured before `since` (by `trained_arm`; every arm for None)
    whose prompt adapt's split puts in training: a superset of what it trained on (curation
    only drops near-duplicates and rows over a key's share)."""
    from specserve.drafter.adapt import split_by_prompt

    rows = [
        {"prompt_token_ids": record.prompt_token_ids, "record": record}
        for record in records
        if record.at < since and trained_arm in (None, record.arm)
    ]
    training, _, _ = split_by_prompt(rows, held_out, validation)
    return [row["record"] for row in training]


def training_digests(
    captured: Path, trained_arm: str | None, since: float, held_out: float, validation: float
) -> frozenset[str]:
    """The prompt digests (wire/requests.py) of what adapt trained on, for the router to leave
    their requests out of the A/B; records captured before digests were kept have none."""
    from specserve.capture import store

    trained = _trained_on(store.read(captured), trained_arm, since, held_out, validation)
    return frozenset(r.prompt_digest for r in trained if r.prompt_digest is not None)


def ab_traffic_seen(
    captured: Path,
    trained_arm: str | None,
    served_arm: str,
    since: float,
    held_out_share: float,
    validation_share: float,
) -> dict:
    """The loop's figure, from the capture store adapt read (in one pass): the prompts trained
    on (captured before `since`, the A/B's start) against those `served_arm` (the incumbent,
    which keeps its capture) captured from `since` on."""
    from specserve.capture import store

    records = list(store.read(captured))
    during = [r.prompt_token_ids for r in records if r.at >= since and r.arm == served_arm]
    if not during:
        return {"unknown": f"{served_arm} captured no request during the A/B"}
    training = _trained_on(records, trained_arm, since, held_out_share, validation_share)
    found = seen_in_training((record.prompt_token_ids for record in training), during)
    return found | {"estimated_from": f"{served_arm}'s capture sample during the A/B"}
