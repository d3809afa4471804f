"""Traffic from a domain the shipped drafters never saw: structured data extraction.

Each request hands the model a short order, booking or support note and asks for a JSON object
with fixed keys. The shipped drafters were trained on prose chat, Python code, documentation and
manual pages (drafter/prompts.py), with no JSON or extraction prompt among them; answers here are
mostly JSON punctuation, keys and values copied from the prompt, which the target predicts and
a drafter trained on prose does not. It is also a common production workload (extraction and
form filling behind an API).

Prompts are built from seeded combinations, so any number can be drawn, and the held-out side
(`held_out=True`) is a disjoint set of combinations: adapted drafters are scored on requests
they did not train on.
"""

from __future__ import annotations

import hashlib
import random

NAMES = [
    "Maria Lopez", "Kenji Sato", "Amara Okafor", "Lukas Berg", "Priya Nair", "Tomasz Nowak",
    "Chloe Martin", "Diego Alvarez", "Aisha Rahman", "Oliver Hughes", "Sofia Rossi",
    "Mateus Silva", "Hana Kim", "Jonas Weber", "Leila Haddad", "Noah Fischer",
]  # fmt: skip
CITIES = [
    "Porto", "Osaka", "Lagos", "Bergen", "Kochi", "Krakow", "Lyon", "Seville", "Dhaka",
    "Leeds", "Turin", "Recife", "Busan", "Graz", "Beirut", "Utrecht",
]  # fmt: skip
ITEMS = [
    "blue kettle", "desk lamp", "yoga mat", "coffee grinder", "rain jacket", "phone case",
    "garden hose", "wool scarf", "bike helmet", "cast-iron pan", "backpack", "alarm clock",
]  # fmt: skip
ISSUES = [
    "arrived broken", "never arrived", "is the wrong colour", "stopped working after a week",
    "was charged twice", "is missing a part",
]  # fmt: skip

TASKS = [
    (
        "Extract the order as JSON with the keys name, city, item, quantity and "
        "express_shipping (true or false). Answer with the JSON only.\n\n"
        "{name} from {city} ordered {quantity} x {item}{express}."
    ),
    (
        "Turn this booking note into JSON with the keys guest, nights, room_type, "
        "arrival_day and breakfast (true or false). Answer with the JSON only.\n\n"
        "{name} will arrive on {day} and stay {nights} nights in a {room} room, "
        "{breakfast}."
    ),
    (
        "Read the support message and return JSON with the keys customer, city, product, "
        "problem and wants_refund (true or false). Answer with the JSON only.\n\n"
        '"Hi, this is {name} in {city}. The {item} I bought {issue}. {request}"'
    ),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ROOMS = ["single", "double", "twin", "family", "suite"]


def extraction_prompt(rng: random.Random) -> str:
    task = rng.choice(TASKS)
    return task.format(
        name=rng.choice(NAMES),
        city=rng.choice(CITIES),
        item=rng.choice(ITEMS),
        quantity=rng.randint(1, 9),
        express=rng.choice(["", ", express shipping please", ", standard shipping"]),
        day=rng.choice(DAYS),
        nights=rng.randint(1, 14),
        room=rng.choice(ROOMS),
        breakfast=rng.choice(["breakfast included", "no breakfast"]),
        issue=rng.choice(ISSUES),
        request=rng.choice(["I would like my money back.", "Please send a replacement."]),
    )


def extraction_requests(count: int, *, held_out: bool = False, seed: int = 0) -> list[list[dict]]:
    """`count` distinct chat requests (message lists); the held-out side never shares a
    prompt with the training side."""
    rng = random.Random(f"extraction:{seed}")
    seen: set[str] = set()
    requests: list[list[dict]] = []
    while len(requests) < count:
        text = extraction_prompt(rng)
        if text in seen:
            continue
        seen.add(text)
        if (hash_side(text) == "held_out") == held_out:
            requests.append([{"role": "user", "content": text}])
    return requests


def hash_side(text: str) -> str:
    """A prompt's side, by a digest of its text: one in five is held out."""
    return "held_out" if hashlib.sha256(text.encode()).digest()[0] % 5 == 0 else "train"
