"""Traffic of many shapes over real text: support tickets about software, triaged as JSON.

An application sends every ticket under one fixed system prompt (the triage instructions and the
answer's keys), as such applications do; the tickets themselves vary: 40 ticket templates across
ten kinds of request (install, crash, regression, speed, documentation, feature, licence,
security, compatibility, how-to), each naming a real Python package installed here with its own
one-line summary from the package's metadata, and versions, systems and errors drawn at random.

What "unseen" means is whole sources, not new slot values: a quarter of the templates and a
quarter of the packages are held out (by a digest of the template's text, of the package's
name), and the held-out side pairs a held-out template with a held-out package. A drafter adapted
on the training side never saw the wording of a held-out ticket nor the package it is about; what
it can carry over is the answer's shape and the target's way of filling it. The long variant
(`long=True`) pastes up to `LONG_CONTEXT_CHARS` of the package's own description under the
ticket, as a user pasting the README they read: prompts of 300 tokens and more.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

from specserve.drafter.prompts import is_held_out

SYSTEM_PROMPT = (
    "You triage support tickets for a software vendor. Read the ticket and reply with JSON only, "
    'with the keys "product", "category" (one of install, crash, regression, performance, docs, '
    'feature, licensing, security, compatibility, question), "priority" (low, medium or high), '
    '"summary" (one sentence) and "next_step" (one sentence).'
)
LONG_CONTEXT_CHARS = 2400
HELD_OUT_EVERY = 4  # one template and one package in four are held out (by digest)

TEMPLATES = [
    # install
    "pip install {package}=={version} fails on {os} with {error}. I only need {about_lc}.",
    "Hello, I cannot get {package} installed in a fresh virtualenv (Python {python}). The "
    "build stops with {error}. Is {version} supposed to support this?",
    "Our CI image ({os}) started failing to install {package} this morning: {error}. We pin "
    "{version}. Nothing changed on our side.",
    "Is there a wheel of {package} {version} for {os}? Building from source takes {minutes} "
    "minutes and then dies with {error}.",
    # crash
    "{package} {version} crashes the whole process with {error} as soon as I call it from a "
    "thread. Single-threaded it works.",
    "After {hours} hours of running, our service that uses {package} ({about_lc}) dies with "
    "{error}. Memory looks fine.",
    "Segfault! {package} {version}, Python {python}, {os}. Stack trace ends in {error}. Can "
    "someone look at this today? Production is down.",
    "Importing {package} raises {error} on {os}. Reinstalling did not help.",
    # regression
    "Upgrading {package} from {old_version} to {version} broke our tests: {count} of them now "
    "fail with {error}.",
    "Since {version}, {package} behaves differently: what worked in {old_version} now gives "
    "{error}. Was this change intended?",
    "We rolled back {package} to {old_version} because {version} made our nightly job "
    "{percent}% slower and sometimes raise {error}.",
    "The changelog of {package} {version} says nothing about it, but our code that relies on "
    "it for {about_lc} stopped working.",
    # performance
    "{package} takes {seconds} seconds for something that should take milliseconds. We use it "
    "for {about_lc} on {os}.",
    "Memory use of {package} {version} grows by {megabytes} MB per hour in our worker. Is there "
    "a known leak?",
    "Our profiler says {percent}% of request time is spent inside {package}. Any settings to "
    "make it faster?",
    "Startup got slow: just importing {package} now takes {seconds} seconds on {os}.",
    # docs
    "The documentation of {package} does not explain how to configure it for {about_lc}. The "
    "example on the front page raises {error}.",
    "There is a typo in the {package} docs for version {version}, and the linked page returns "
    "404. Who maintains them?",
    "Could you document which Python versions {package} {version} supports? The page only "
    "lists up to {python}.",
    "The tutorial for {package} skips the step between installing it and the first call; new "
    "colleagues get {error} every time.",
    # feature
    "Feature request: {package} should support async use. We use it for {about_lc} and "
    "everything else in our stack is async.",
    "Would you accept a patch that adds a progress bar to {package}? Long jobs look frozen.",
    "Please add type hints to {package}. Our checker reports {count} errors in code that uses "
    "it.",
    "It would help if {package} could read its settings from environment variables, like "
    "everything else on our {os} servers.",
    # licensing
    "Legal asks whether we may ship {package} {version} inside a closed-source product. Which "
    "licence applies?",
    "We need a software bill of materials: what licences do {package} and its dependencies "
    "use?",
    "Our company ({company}) wants a support contract for {package}. Who do we talk to about "
    "pricing for {seats} seats?",
    "Does the licence of {package} allow modifying it for internal use only?",
    # security
    "Our scanner flags {package} {version} with a known vulnerability. Is there a fixed "
    "release?",
    "I think I found a security problem in {package}: untrusted input reaches {error}. How do "
    "I report it privately?",
    "Does {package} send any data over the network? We use it for {about_lc} on machines "
    "without internet access.",
    "Is {package} {version} signed? We must verify every package our {company} build system "
    "downloads.",
    # compatibility
    "Does {package} {version} work with Python {python}? Our upgrade is blocked on it.",
    "{package} and our other dependencies disagree about versions; pip reports a conflict "
    "around {old_version}. How should we resolve it?",
    "Running {package} on {os} gives different results than on our laptops. Is this expected?",
    "Can {package} run on ARM machines? We are moving {count} servers to {os}.",
    # how-to
    "How do I use {package} for {about_lc} in a script that runs every {minutes} minutes?",
    "What is the recommended way to test code that depends on {package}? Mocking it raises "
    "{error}.",
    "Quick question: is {package} the right tool for {about_lc}, or is there something more "
    "suitable for a team of {seats}?",
    "How do I turn on debug logging in {package} {version}? I want to see why a call takes "
    "{seconds} seconds.",
]  # fmt: skip

SYSTEMS = [
    "Ubuntu 22.04", "Ubuntu 24.04", "Debian 12", "Alpine 3.19", "macOS 14", "Windows 11",
    "Fedora 40", "Amazon Linux 2023", "RHEL 9", "Arch Linux",
]  # fmt: skip
ERRORS = [
    "ImportError: cannot import name 'Config'", "MemoryError", "RecursionError: maximum "
    "recursion depth exceeded", "OSError: [Errno 24] Too many open files", "KeyError: 'id'",
    "TypeError: 'NoneType' object is not iterable", "UnicodeDecodeError: 'utf-8' codec can't "
    "decode byte 0xff", "error: Microsoft Visual C++ 14.0 or greater is required",
    "ModuleNotFoundError: No module named '_ctypes'", "ValueError: buffer source array is "
    "read-only", "PermissionError: [Errno 13] Permission denied", "TimeoutError",
    "AttributeError: module has no attribute 'run'", "SSL: CERTIFICATE_VERIFY_FAILED",
    "Fatal Python error: Segmentation fault", "RuntimeError: event loop is closed",
]  # fmt: skip
COMPANIES = [
    "Northwind Logistics", "Blue Harbor Bank", "Kestrel Robotics", "Lumen Health",
    "Orchard Retail", "Tidewater Energy", "Granite Insurance", "Fable Games",
]  # fmt: skip


@dataclass(frozen=True)
class Package:
    name: str
    about: str  # the one-line summary from its metadata
    description: str  # the long description, possibly empty


@functools.cache
def installed_packages() -> tuple[Package, ...]:
    """The installed distributions with a one-line summary, by name (the same set wherever the
    lock file was installed)."""
    from importlib import metadata

    found: dict[str, Package] = {}
    for dist in metadata.distributions():
        fields = dist.metadata.json  # lower-case keys; the long description under "description"
        name = str(fields.get("name") or "")
        about = " ".join(str(fields.get("summary") or "").split())
        if name and len(about) >= 20:
            description = str(fields.get("description") or "")
            found.setdefault(name.lower(), Package(name, about.rstrip("."), description))
    return tuple(found[name] for name in sorted(found))


def sides() -> dict[bool, tuple[list[str], list[Package]]]:
    """{held out?: (templates, packages)}; each side nonempty."""
    packages = installed_packages()
    split = {
        side: (
            [t for t in TEMPLATES if is_held_out(t, HELD_OUT_EVERY) == side],
            [p for p in packages if is_held_out(p.name, HELD_OUT_EVERY) == side],
        )
        for side in (False, True)
    }
    for side, (templates, chosen) in split.items():
        if not templates or not chosen:
            missing = "held-out" if side else "training"
            raise RuntimeError(f"the ticket domain has no {missing} side")
    return split


@functools.cache  # a long ticket pastes it, and a draw asks for it per package
def _context(package: Package) -> str:
    """The package's description as pasted text: markup lines dropped, cut at a line end."""
    markup = re.compile(r"\s*(\.\.|<|!\[|\[!)")  # directives, HTML, images and badges
    lines = [ln for ln in package.description.splitlines() if not markup.match(ln)]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    if len(text) > LONG_CONTEXT_CHARS:
        text = text[: text.rfind("\n", 0, LONG_CONTEXT_CHARS) + 1 or LONG_CONTEXT_CHARS].rstrip()
    return text or package.about


def ticket(template: str, package: Package, rng: random.Random, *, long: bool = False) -> str:
    major = rng.randint(0, 4)
    text = template.format(
        package=package.name,
        about_lc=package.about[0].lower() + package.about[1:],
        version=f"{major}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
        old_version=f"{max(major - 1, 0)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
        python=f"3.{rng.randint(9, 13)}",
        os=rng.choice(SYSTEMS),
        error=rng.choice(ERRORS),
        company=rng.choice(COMPANIES),
        count=rng.randint(2, 400),
        percent=rng.randint(5, 90),
        seconds=rng.randint(2, 90),
        minutes=rng.randint(2, 60),
        hours=rng.randint(2, 72),
        megabytes=rng.randint(5, 900),
        seats=rng.randint(3, 500),
    )
    if long:
        text += f"\n\nThis is the {package.name} description I was reading:\n\n{_context(package)}"
    return text


def ticket_requests(
    count: int, *, held_out: bool = False, seed: int = 0, long: bool = False
) -> list[list[dict]]:
    """`count` distinct chat requests (message lists) from one side: the held-out side shares
    no template and no package with the training side."""
    templates, packages = sides()[held_out]
    if long:  # only packages with enough description to make a long prompt
        packages = [p for p in packages if len(_context(p)) >= LONG_CONTEXT_CHARS // 2]
    rng = random.Random(f"tickets:{seed}:{held_out}:{long}")
    seen: set[str] = set()
    requests: list[list[dict]] = []
    for _ in range(count * 50):
        text = ticket(rng.choice(templates), rng.choice(packages), rng, long=long)
        if text not in seen:
            seen.add(text)
            requests.append(
                [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
            )
        if len(requests) == count:
            return requests
    raise RuntimeError(f"the ticket domain drew only {len(requests)} distinct requests")
