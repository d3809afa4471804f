"""The ticket domain (drafter/tickets.py): what its held-out side holds out is whole templates
and whole packages, not slot values."""

from __future__ import annotations

import string

from specserve.drafter import tickets
from specserve.drafter.prompts import is_held_out
from specserve.drafter.tickets import (
    HELD_OUT_EVERY,
    SYSTEM_PROMPT,
    TEMPLATES,
    sides,
    ticket_requests,
)


def template_of(text: str) -> str:
    """The template a ticket was drawn from: the one whose fixed words it holds, in order."""
    for template in TEMPLATES:
        pieces = [literal for literal, *_ in string.Formatter().parse(template) if literal]
        at = 0
        for piece in pieces:
            at = text.find(piece, at)
            if at < 0:
                break
            at += len(piece)
        else:
            return template
    raise AssertionError(f"no template wrote {text!r}")


def test_the_held_out_side_shares_no_template_and_no_package_with_training():
    (train_templates, train_packages), (test_templates, test_packages) = (
        sides()[False],
        sides()[True],
    )
    assert len(TEMPLATES) >= 40 and len(test_templates) >= 5 and len(train_templates) >= 20
    assert not set(train_templates) & set(test_templates)
    assert not {p.name for p in train_packages} & {p.name for p in test_packages}
    assert all(is_held_out(t, HELD_OUT_EVERY) for t in test_templates)
    assert not any(is_held_out(t, HELD_OUT_EVERY) for t in train_templates)

    for side, (templates, packages) in ((False, sides()[False]), (True, sides()[True])):
        names = {p.name for p in packages}
        for messages in ticket_requests(200, held_out=side, seed=3):
            system, user = messages
            assert system == {"role": "system", "content": SYSTEM_PROMPT}
            assert template_of(user["content"]) in templates
            mentioned = {p.name for p in tickets.installed_packages() if p.name in user["content"]}
            assert mentioned & names, user["content"]


def test_the_training_side_covers_many_templates_and_draws_differ_by_seed():
    first, second = ticket_requests(300, seed=0), ticket_requests(300, seed=1)
    used = {template_of(m[1]["content"]) for m in first}
    assert len(used) == len(sides()[False][0])  # every training template drawn
    assert first != second


def test_long_tickets_paste_the_packages_description():
    for messages in ticket_requests(30, held_out=True, long=True):
        text = messages[1]["content"]
        ticket, _, pasted = text.partition(" description I was reading:\n\n")
        assert len(pasted) >= tickets.LONG_CONTEXT_CHARS // 2
        assert len(pasted) <= tickets.LONG_CONTEXT_CHARS
