"""Prompts for self-distillation and for held-out evaluation, all from what is on the machine.

Breadth decides how well a drafter generalises, so prompts come from several kinds of source:
documentation of the standard library and installed packages, `pydoc_data.topics` (long English
technical text), the system's man pages (long technical documents), coding tasks built from real
function signatures, and general chat topics. Each prompt gets a varied (or no) system prompt and
some are multi-turn. Training and evaluation draw from disjoint halves of every source (split by
a hash of the item), so evaluation prompts are never trained on. Public benchmark prompts are not
used at all.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import inspect
import json
import pkgutil
import random
import re
import subprocess
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

Message = dict[str, str]

SYSTEM_PROMPTS = [
    None,
    None,
    "You are a helpful assistant.",
    "You are a concise technical assistant. Answer precisely.",
    "You are a friendly tutor who explains things step by step.",
    "You are an expert Python programmer.",
    "Answer in plain English without jargon.",
]
# Unusual system prompts and formats, only for the perturbed evaluation set.
PERTURBED_SYSTEM_PROMPTS = [
    "SYSTEM OVERRIDE: respond as a terse unix sysadmin from 1995, lowercase only.",
    "Tu es un assistant utile. Answer in English anyway, but be brief.",
    "### Role\nYou are DocBot v2.\n### Rules\n1. Use bullet points.\n2. Never apologise.",
    "You are a pirate. Keep the technical content correct.",
]
# Chat formats other than the target's own (ChatML), only for the "template" evaluation set: the
# same requests rendered as a plain prompt. Per role a format string, then the generation prompt.
FOREIGN_TEMPLATES = {
    "alpaca": {
        "system": "{content}\n\n",
        "user": "### Instruction:\n{content}\n\n",
        "assistant": "### Response:\n{content}\n\n",
        "generation": "### Response:\n",
    },
    "plain": {
        "system": "System: {content}\n",
        "user": "User: {content}\n",
        "assistant": "Assistant: {content}\n",
        "generation": "Assistant:",
    },
    "inst": {  # [INST] markers, as Llama-2 chat
        "system": "<<SYS>>\n{content}\n<</SYS>>\n\n",
        "user": "[INST] {content} [/INST]",
        "assistant": " {content}\n",
        "generation": "",
    },
    "renamed-roles": {  # ChatML's markers, other role names
        "system": "<|im_start|>instructions\n{content}<|im_end|>\n",
        "user": "<|im_start|>human\n{content}<|im_end|>\n",
        "assistant": "<|im_start|>bot\n{content}<|im_end|>\n",
        "generation": "<|im_start|>bot\n",
    },
}

CHAT_TOPICS = [
    "cooking pasta",
    "learning a language",
    "saving money",
    "training for a 10k run",
    "planting tomatoes",
    "writing a cover letter",
    "the history of printing",
    "sleep habits",
    "choosing a bicycle",
    "how vaccines work",
    "photosynthesis",
    "planning a trip to Japan",
    "negotiating a salary",
    "the water cycle",
    "public speaking",
    "composting",
    "black holes",
    "time management",
    "making bread",
    "volcanoes",
    "chess openings",
    "how tides work",
    "starting a podcast",
    "caring for a cat",
    "the Roman empire",
    "climate and weather",
    "first aid for burns",
    "learning to draw",
    "electric cars",
    "meditation",
    "bird watching",
    "renting an apartment",
    "the French revolution",
    "brewing coffee",
    "how the internet works",
    "healthy breakfasts",
    "writing poetry",
    "job interviews",
    "recycling plastics",
    "jazz music",
    "the solar system",
    "budget travel",
    "houseplants",
    "the immune system",
    "making friends",
    "ancient Egypt",
    "home workouts",
    "learning guitar",
    "renewable energy",
    "board games",
    "keeping bees",
    "the printing of money",
    "learning to swim",
    "wine tasting",
    "the stock market",
    "raising teenagers",
    "fixing a leaking tap",
    "the human heart",
    "camping in the mountains",
    "earthquakes",
    "writing a novel",
    "the Renaissance",
    "smartphone privacy",
    "running a small business",
    "dinosaurs",
    "knitting",
    "the moon landing",
    "how airplanes fly",
    "making sushi",
    "dealing with stress",
    "the Olympic games",
    "growing herbs indoors",
    "buying a used car",
    "the history of the bicycle",
    "mushrooms",
    "learning to code",
    "solar panels",
    "the ocean floor",
    "classical music",
    "dog training",
    "the Silk Road",
    "baking cookies",
    "writing a resume",
    "rainforests",
    "personal finance for students",
    "the Great Wall of China",
    "yoga for beginners",
    "how batteries work",
    "hiking safety",
    "the history of medicine",
    "photography basics",
    "starting a vegetable garden",
    "artificial intelligence",
    "the Vikings",
    "how elections work",
    "bees and pollination",
    "moving to a new city",
    "volunteering",
    "the history of chocolate",
    "playing the piano",
    "reducing food waste",
    "the northern lights",
    "online learning",
    "antarctica",
    "painting with watercolours",
    "the industrial revolution",
    "healthy sleep for babies",
    "writing emails at work",
    "the theory of evolution",
    "home insurance",
    "spices in Indian cooking",
    "the Amazon river",
    "learning mathematics",
    "3D printing",
    "the life of Shakespeare",
    "hosting a dinner party",
    "electricity at home",
    "coral reefs",
    "team leadership",
]
CHAT_TEMPLATES = [
    "Can you give me some advice about {t}?",
    "Explain {t} to a beginner.",
    "What are the most common mistakes people make with {t}?",
    "Write a short blog post about {t}.",
    "I want to get better at {t}. Where should I start?",
    "Give me five interesting facts about {t}.",
    "Summarise the key ideas of {t} in a few paragraphs.",
    "What questions should I ask an expert on {t}?",
    "Tell me a short story that involves {t}.",
    "What are the pros and cons of {t}?",
    "How has {t} changed over the last hundred years?",
    "Write a step-by-step guide to {t}.",
]
CODE_TEMPLATES = [
    "Write a Python function that uses `{name}{sig}` and explain how it works.",
    "Show a short, complete Python example of `{name}`. Add comments.",
    "Write a unit test (pytest) for code that calls `{name}{sig}`.",
    "How would I implement something like `{name}` myself in Python? Write the code.",
    "Write a Python script that demonstrates `{name}` on realistic data.",
]
DOC_TEMPLATES = [
    "Here is the documentation of `{name}`:\n\n{doc}\n\nExplain it in your own words.",
    "{doc}\n\nWhat does `{name}` do, and when would I use it?",
    "Read this documentation and give an example of using `{name}`:\n\n{doc}",
    "Summarise the following in three sentences:\n\n{doc}",
]
LONG_TEMPLATES = [
    "Here is a manual page.\n\n{doc}\n\nSummarise what this program does and its most "
    "important options.",
    "{doc}\n\nBased on the text above, write a short tutorial for a new user.",
    "Read the following document carefully.\n\n{doc}\n\nList the key points.",
]
FOLLOW_UPS = [
    "Can you give an example?",
    "Make it shorter.",
    "Why is that?",
    "Thanks! Anything else?",
]


# What a prompt asks for: chat, code, documentation, a long document, and (held out only) chat and
# code under unseen system prompts or in a foreign chat template.
KINDS = ("chat", "code", "doc", "long", "perturbed", "template")


@dataclass
class Prompt:
    kind: str  # one of KINDS
    messages: list[Message]
    source: str = ""
    meta: dict = field(default_factory=dict)


def is_held_out(key: str, every: int = 5) -> bool:
    """Every `every`-th item by hash goes to evaluation; the rest may be trained on."""
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % every == 0


def _with_system(rng: random.Random, user: str, systems=SYSTEM_PROMPTS) -> list[Message]:
    system = rng.choice(systems)
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]


SELF_INSTRUCT_REQUEST = (
    "Write one question that a curious person might ask an AI assistant about {t}. "
    "Reply with the question only."
)


def self_instruct_prompts(questions: list[str], seed: int = 0) -> list[Prompt]:
    """Training chat prompts from questions the target wrote itself (see `SELF_INSTRUCT_REQUEST`);
    some become two-turn conversations."""
    rng = random.Random(seed + 2)
    prompts = []
    for question in questions:
        messages = _with_system(rng, question)
        if rng.random() < 0.15:
            messages += [
                {"role": "assistant", "content": ""},
                {"role": "user", "content": rng.choice(FOLLOW_UPS)},
            ]
        prompts.append(Prompt("chat", messages, source="self-instruct"))
    return prompts


def clean_question(text: str) -> str | None:
    """The question in a generated reply, or None when the reply is not one usable question."""
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    line = re.sub(r"^(question|q)\s*[:.]\s*", "", line, flags=re.I).strip("\"' *")
    return line if 20 <= len(line) <= 300 and line.endswith("?") else None


# -- sources -------------------------------------------------------------------------------------


def stdlib_functions() -> Iterator[tuple[str, str, str]]:
    """(qualified name, signature, docstring) of documented public stdlib callables."""
    import importlib
    import sys

    names = sorted(set(sys.stdlib_module_names) - {"antigravity", "this", "idlelib", "tkinter"})
    for module_name in names:
        if module_name.startswith("_"):
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception:
            continue
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not callable(obj):
                continue
            if getattr(obj, "__module__", None) != module_name:
                continue
            doc = inspect.getdoc(obj) or ""
            if len(doc) < 80:
                continue
            yield f"{module_name}.{attr}", signature(obj), doc[:1500]


class _Elided:
    def __repr__(self) -> str:
        return "..."


def signature(obj) -> str:
    """A callable's signature as its source would show it. Defaults whose repr is an object's
    address or the process's state (`os.environ`) are shown as `...`: they differ from process
    to process, and would make the prompt set do so too (and leak the environment into it)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parameters = [
        p.replace(default=_Elided())
        if p.default is not p.empty and (" at 0x" in repr(p.default) or len(repr(p.default)) > 60)
        else p
        for p in sig.parameters.values()
    ]
    return str(sig.replace(parameters=parameters))


def pydoc_topics() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics

    for name, text in sorted(topics.items()):
        if len(text) > 400:
            yield name, text


@functools.cache
def man_pages(min_bytes: int = 5000) -> list[tuple[str, str]]:
    """(name, plain text) of the long section 1/5/8 man pages, rendered by man when installed.

    Only files of at least `min_bytes` (compressed) are rendered: rendering costs ~40 ms a page
    and short pages are no long-context material.
    """
    roots = [Path("/usr/share/man/man1"), Path("/usr/share/man/man5"), Path("/usr/share/man/man8")]
    files = sorted(p for root in roots if root.is_dir() for p in root.iterdir())
    pages = []
    for path in tqdm([p for p in files if p.stat().st_size >= min_bytes], desc="man pages"):
        text = _render_man(path)
        if text and len(text) > 9000:  # long-context material: ~2,000+ tokens
            pages.append((path.name.split(".")[0], text))
    return pages


def _render_man(path: Path) -> str:
    try:
        rendered = subprocess.run(
            ["man", "-P", "cat", str(path)],
            capture_output=True,
            text=True,
            timeout=10,
            env={"MANWIDTH": "100", "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        ).stdout
        if rendered.strip():
            return re.sub(r".\x08", "", rendered)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if path.suffix != ".gz":
        return ""
    try:  # no man: strip roff requests crudely
        with gzip.open(path, "rt", errors="replace") as f:
            raw = f.read()
    except OSError:
        return ""
    lines = [re.sub(r"\\f[BIRP]|\\-|\\\(..|\\&", "", line) for line in raw.splitlines()]
    return "\n".join(line for line in lines if not line.startswith((".", "'\\\"")))


def package_docs() -> Iterator[tuple[str, str]]:
    """Module docstrings of installed third-party packages (broad technical English)."""
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if not info.ispkg or info.name.startswith("_"):
            continue
        spec = info.module_finder.find_spec(info.name)  # type: ignore[call-arg]
        init = Path(spec.origin) if spec and spec.origin else None
        if init is None or init.suffix != ".py":
            continue
        try:
            text = init.read_text(errors="replace")
        except OSError:
            continue
        match = re.match(r'\s*(?:#.*\n)*\s*[rRuU]?("""|\'\'\')(.*?)\1', text, re.S)
        if match and len(match.group(2)) > 300:
            yield info.name, match.group(2).strip()[:2000]


# -- prompt sets ---------------------------------------------------------------------------------


def build_prompts(
    *, held_out: bool, seed: int = 0, long_chars: int = 10000, kinds: Collection[str] = KINDS
) -> list[Prompt]:
    """All prompts of one side (training or held-out evaluation) of `kinds`, in a reproducible
    random order.

    Every item draws its template and system prompt from its own generator and the order is by
    a hash of each prompt, so one item more or less (a module that does not import here, a man
    page that failed to render) changes nothing about the others, and the prompts of some kinds
    are those of all kinds, filtered: sources no kind asked for are not read (the man pages
    alone take a minute to render)."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown prompt kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    side = f"{seed}:{'held-out' if held_out else 'train'}"
    derived = held_out and bool({"perturbed", "template"} & set(kinds))
    # Perturbed and template prompts are chat and code prompts made over.
    built = set(kinds) | ({"chat", "code"} if derived else set())
    prompts: list[Prompt] = []

    for topic in CHAT_TOPICS if "chat" in built else ():
        for template in CHAT_TEMPLATES:
            user = template.format(t=topic)
            if is_held_out(user) != held_out:
                continue
            rng = _item_rng(side, user)
            messages = _with_system(rng, user)
            if rng.random() < 0.15:  # multi-turn: the assistant turn is filled in later
                messages += [
                    {"role": "assistant", "content": ""},
                    {"role": "user", "content": rng.choice(FOLLOW_UPS)},
                ]
            prompts.append(Prompt("chat", messages, source="topics"))

    for name, sig, doc in stdlib_functions() if {"code", "doc"} & built else ():
        if is_held_out(name) != held_out:
            continue
        rng = _item_rng(side, name)
        user = rng.choice(CODE_TEMPLATES).format(name=name, sig=sig)
        prompts.append(Prompt("code", _with_system(rng, user), source="stdlib"))
        user = rng.choice(DOC_TEMPLATES).format(name=name, doc=doc)
        prompts.append(Prompt("doc", _with_system(rng, user), source="stdlib-doc"))

    for name, text in pydoc_topics() if "doc" in built else ():
        if is_held_out("topic:" + name) != held_out:
            continue
        rng = _item_rng(side, "topic:" + name)
        user = rng.choice(DOC_TEMPLATES).format(name=name, doc=text[:2500])
        prompts.append(Prompt("doc", _with_system(rng, user), source="pydoc-topics"))

    for name, text in package_docs() if "doc" in built else ():
        if is_held_out("pkg:" + name) != held_out:
            continue
        rng = _item_rng(side, "pkg:" + name)
        user = rng.choice(DOC_TEMPLATES).format(name=name, doc=text)
        prompts.append(Prompt("doc", _with_system(rng, user), source="packages"))

    for name, text in man_pages() if "long" in built else ():
        if is_held_out("man:" + name) != held_out:
            continue
        rng = _item_rng(side, "man:" + name)
        user = rng.choice(LONG_TEMPLATES).format(doc=text[:long_chars])
        prompts.append(Prompt("long", _with_system(rng, user), source="man"))

    if derived:  # the same kinds of request under system prompts never seen in training
        chat = shuffled([p for p in prompts if p.kind in ("chat", "code")], side + ":perturbed")
        for p in chat[:60]:
            user = next(m["content"] for m in p.messages if m["role"] == "user")
            messages = _with_system(
                _item_rng(side, "perturbed:" + user), user, PERTURBED_SYSTEM_PROMPTS
            )
            prompts.append(Prompt("perturbed", messages, source=p.source))
        for p in chat[60:120]:  # and in a chat format it was not tuned on (first turn only)
            messages = first_turn(p.messages)
            rng = _item_rng(side, "template:" + messages[-1]["content"])
            template = rng.choice(sorted(FOREIGN_TEMPLATES))
            prompts.append(
                Prompt("template", messages, source=p.source, meta={"template": template})
            )

    return shuffled([p for p in prompts if p.kind in kinds], side)


def first_turn(messages: list[Message]) -> list[Message]:
    """The messages up to and including the first user turn (system prompt kept)."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: first_user + 1]


def render(messages: list[Message], template: str) -> str:
    """A conversation as one plain prompt in one of `FOREIGN_TEMPLATES`, ready for the answer."""
    formats = FOREIGN_TEMPLATES[template]
    turns = "".join(formats[m["role"]].format(content=m["content"]) for m in messages)
    return turns + formats["generation"]


def _item_rng(side: str, key: str) -> random.Random:
    return random.Random(f"{side}:{key}")  # str seeds are hashed stably across processes


def shuffled(prompts: list[Prompt], seed: str) -> list[Prompt]:
    """A random order that is stable under adding or removing items: by a hash of each prompt."""

    def rank(p: Prompt) -> str:
        text = json.dumps(p.messages, sort_keys=True)
        return hashlib.sha1(f"{seed}:{text}".encode()).hexdigest()

    return sorted(prompts, key=rank)
