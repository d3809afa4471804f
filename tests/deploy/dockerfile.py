"""A parser of Dockerfiles and .dockerignore files, for the Dockerfile checks in test_dockerfile.py.

It reads what those checks need, without a container engine: instructions with their line
continuations joined as Docker joins them, stages with their base images (build arguments
substituted), the stages a target is built from, its environment and last USER/CMD/...; and the
build context's .dockerignore rules with Docker's pattern matching. A RUN or COPY heredoc
raises NotImplementedError.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the logical line, continuations joined as Docker joins them
    line: int  # where it starts in the file


@dataclass
class Stage:
    index: int
    base: str  # build arguments substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Instructions as (first line number, text). A trailing backslash continues a line; Docker
    removes the backslash and the newline and skips comment and empty lines inside."""
    lines: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # also drops the parser directives (# syntax=...), which are comments too
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(raw.rstrip()[:-1])
            continue
        parts.append(raw)
        lines.append((start, "".join(parts).strip()))
        parts = []
    if parts:
        raise ValueError(f"line {start}: continuation runs past the end of the file")
    return lines


def expand(value: str, args: dict[str, str]) -> str:
    """Substitute ${NAME}, ${NAME:-default} and $NAME from build arguments; unknown ones stay."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        if name in args:
            return args[name]
        return match.group(2) if match.group(2) is not None else match.group(0)

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", one, value)


def assignments(args: str) -> dict[str, str]:
    """`KEY=value KEY2="value 2"` of ENV, LABEL and ARG (also the old `ENV KEY value`)."""
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])} if len(tokens) > 1 else {tokens[0]: ""}
    return dict(token.split("=", 1) if "=" in token else (token, "") for token in tokens)


def leading_flags(args: str) -> tuple[dict[str, str], str]:
    """`--name=value` flags in front of a COPY/ADD/RUN/FROM and the rest of the line."""
    flags: dict[str, str] = {}
    rest = args
    while match := re.match(r"--([\w-]+)(?:=(\S+))?\s+", rest):
        flags[match.group(1)] = match.group(2) or ""
        rest = rest[match.end() :]
    return flags, rest


def mount_options(flag: str) -> dict[str, str]:
    return dict(part.split("=", 1) if "=" in part else (part, "") for part in flag.split(","))


@dataclass
class Dockerfile:
    args: dict[str, str]  # global build arguments (before the first FROM) with their defaults
    stages: list[Stage]

    @classmethod
    def parse(cls, text: str) -> Dockerfile:
        args: dict[str, str] = {}
        stages: list[Stage] = []
        for line, logical in logical_lines(text):
            keyword, _, rest = logical.partition(" ")
            instruction = Instruction(keyword.upper(), rest.strip(), line)
            if re.search(r"(?<![<\d])<<-?[\"']?[A-Za-z_]", rest) and instruction.keyword in (
                "RUN",
                "COPY",
            ):
                raise NotImplementedError(f"line {line}: heredocs are not parsed here")
            if instruction.keyword == "FROM":
                _, image = leading_flags(instruction.args)
                tokens = image.split()
                name = tokens[2] if len(tokens) >= 3 and tokens[1].upper() == "AS" else None
                stages.append(Stage(len(stages), expand(tokens[0], args), name))
            elif not stages:
                if instruction.keyword == "ARG":
                    args.update(assignments(instruction.args))
            else:
                stages[-1].instructions.append(instruction)
        return cls(args, stages)

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def _ref(self, ref: str) -> Stage | None:
        if ref.isdigit() and int(ref) < len(self.stages):
            return self.stages[int(ref)]
        return self.stage(ref)

    def lineage(self, stage: Stage) -> list[Stage]:
        """The stage and the stages it is built FROM, base first: what its image inherits."""
        chain = [stage]
        while (parent := self.stage(chain[0].base)) is not None and parent.index < chain[0].index:
            chain.insert(0, parent)
        return chain

    def inherited(self, stage: Stage) -> list[Instruction]:
        return [i for s in self.lineage(stage) for i in s.instructions]

    def needs(self, stage: Stage) -> list[Stage]:
        """Every stage whose result ends up in `stage`: FROM, COPY --from and RUN mounts."""
        seen: dict[int, Stage] = {}
        todo = [stage]
        while todo:
            current = todo.pop()
            if current.index in seen:
                continue
            seen[current.index] = current
            refs = [current.base]
            for instruction in current.instructions:
                flags, _ = leading_flags(instruction.args)
                if instruction.keyword in ("COPY", "ADD") and "from" in flags:
                    refs.append(flags["from"])
                if instruction.keyword == "RUN":
                    for flag in re.findall(r"--mount=(\S+)", instruction.args):
                        refs.append(mount_options(flag).get("from", ""))
            todo += [s for ref in refs if (s := self._ref(ref)) is not None]
        return sorted(seen.values(), key=lambda s: s.index)

    def env(self, stage: Stage) -> dict[str, str]:
        values: dict[str, str] = {}
        for instruction in self.inherited(stage):
            if instruction.keyword == "ENV":
                values.update(assignments(instruction.args))
        return values

    def last(self, stage: Stage, keyword: str) -> Instruction | None:
        found = [i for i in self.inherited(stage) if i.keyword == keyword]
        return found[-1] if found else None


def ignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as (is an exception `!`, compiled pattern), in file order."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
        rules.append((negate, re.compile(glob_regex(pattern))))
    return rules


def glob_regex(pattern: str) -> str:
    """Docker's pattern syntax: `*` and `?` within one path element, `**` across elements."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 1)) != -1:
            body = pattern[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body[:1] in "!^" and body else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "^" + "".join(out) + "$"


def is_ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the build context leaves `path` out: a pattern matching a directory covers
    everything below it, and the last pattern that matches decides."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for negate, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            ignored = not negate
    return ignored
