"""Router config: the schema of the YAML document, loading, and the revision hash.

One document describes the public model, the arms (draft configurations) with their weights, how
requests stick to arms, and request limits. Its revision is a hash of the file's bytes, so the
same file always has the same revision and a rollback restores the old revision exactly.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specserve import headers, k_schedule
from specserve.capture.store import DEFAULT_MAX_BYTES
from specserve.config import policy
from specserve.config.bounded_yaml import MAX_CONFIG_BYTES, RefusedDocument, load_yaml

# The longest a request may run (limits.request_timeout_s); an arm's replica being stopped waits
# this long at most for its requests, each of which its own timeout ends sooner.
MAX_REQUEST_TIMEOUT_S = 86_400
ARM_NAME_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,40}[a-z0-9])?$"
# A lower-case HTTP header name (an RFC 9110 token), as ASGI delivers header names.
HEADER_NAME_PATTERN = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]{1,64}$")
# Headers that cannot pin sessions, and why.
UNSTICKY_HEADERS = {
    headers.REQUEST_ID: "differs on every request",
    headers.AUTHORIZATION: "carries credentials, which the router must not keep as sticky keys",
    "proxy-authorization": "carries credentials, which the router must not keep as sticky keys",
    "cookie": "carries credentials, which the router must not keep as sticky keys",
    "host": "is the same for every client",
    "content-type": "is the same for every client",
    "content-length": "describes the request, not the client",
}
# Every `x-specserve-*` header is the platform's own: set or removed by the dispatch.
# Drafters shipped with the package are named by their directory under specserve/drafters.
PACKAGE_SCHEME = "package://"
PACKAGED_DRAFTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# A Hugging Face hub repository (`org/name`), as vLLM takes a source that is no local directory:
# the chart refuses the same sources (_generated.tpl). A relative directory of that shape counts
# as one; `./org/name` says it is local.
HUB_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$"
# A pin is a commit id: a branch or a tag can be moved by whoever can push to the repository.
COMMIT_PATTERN = r"^[0-9a-f]{40}$"
# vLLM's engine arguments that `model.revision` sets: weights, code and tokenizer, one commit.
MODEL_REVISION_ARGS = ("revision", "code_revision", "tokenizer_revision")
# An arm's settings that Ray Serve applies to its running engine replicas without restarting
# them, by their Ray Serve deployment option name (serve_config.py passes them as such).
DEPLOYMENT_OPTIONS = {
    "replicas": "num_replicas",
    "max_ongoing_requests": "max_ongoing_requests",
    "max_queued_requests": "max_queued_requests",
    "max_surge_percent": "max_surge_percent",
}
# An arm's settings its running engine replicas take in place: Ray Serve hands them to each
# replica as the deployment's `user_config` (engine/front.py, `ArmServer.reconfigure`), without
# building the application again or restarting an engine.
RELOADED_IN_PLACE = ("drafter_weights",)
# vLLM's own `max_num_seqs` default: what an engine batches when the arm does not say.
DEFAULT_MAX_NUM_SEQS = 256
# Keys that moved; the error for an old key names its replacement.
RENAMED_KEYS = {"num_draft_tokens": "num_speculative_tokens", "draft_model": "model"}


class ConfigError(ValueError):
    """A config document that cannot be served; the message names the bad field."""


class _Strict(BaseModel):
    # NaN and infinities (YAML's `.nan`, `.inf`) are refused in every float field: a weight of
    # inf would make every weighted request fail in arm selection.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in RENAMED_KEYS.items():
                if old in data:
                    raise ValueError(f"`{old}` was renamed to `{new}`")
        return data


class ModelConfig(_Strict):
    name: str = Field(
        description="Public model name: what clients send as `model` and see in /v1/models."
    )
    source: str = Field(
        description="What the engines load: `embedded://NAME`, a local directory or a hub id."
    )
    max_model_len: int | None = Field(
        None, gt=0, description="Context length (prompt + output tokens); engine default if unset."
    )
    accelerator: Literal["gpu", "cpu"] = Field(
        "gpu", description="Hardware the engines run on: `gpu` (one GPU per replica) or `cpu`."
    )
    revision: str | None = Field(
        None,
        pattern=COMMIT_PATTERN,
        description="The commit of the hub repository `source` that the engines load (weights, "
        "tokenizer and, with trust_remote_code, code): 40 hex digits. Required where an arm "
        "sets trust_remote_code and `source` is a hub id.",
    )

    @model_validator(mode="after")
    def _revision_pins_a_hub_repository(self) -> ModelConfig:
        check_pin(self.source, self.revision)
        return self


def is_hub_id(source: str) -> bool:
    """Whether vLLM takes `source` from the Hugging Face hub (no scheme, no local path)."""
    return re.match(HUB_ID_PATTERN, source) is not None


def check_pin(source: str, revision: str | None) -> None:
    """A `revision` pins a hub repository: on any other source it is refused."""
    if revision is not None and not is_hub_id(source):
        raise ValueError(f"`revision` pins a hub repository; `{source}` is none")


def unpinned_code(model: ModelConfig, arm: ArmEngineConfig) -> str | None:
    """Why this arm's engine would run code from a hub repository that no commit pins (with
    trust_remote_code vLLM runs the code in the target's and the drafter's repositories, and
    whoever can push there would run theirs in the engines), or None."""
    if not arm.engine.get("trust_remote_code"):
        return None
    if is_hub_id(model.source) and model.revision is None:
        return (
            f"arm {arm.name!r} sets trust_remote_code, so its engines run the code in the hub "
            f"repository {model.source}: pin the commit you reviewed with `model.revision` "
            "(40 hex digits)"
        )
    drafter = getattr(arm.speculative, "model", None)
    if drafter and is_hub_id(drafter) and arm.speculative.revision is None:  # type: ignore[union-attr]
        return (
            f"arm {arm.name!r} sets trust_remote_code, so its engines also run the code in its "
            f"drafter's hub repository {drafter}: pin the commit you reviewed with "
            "`speculative.revision` (40 hex digits)"
        )
    return None


def check_packaged_drafter_name(source: str) -> None:
    """A packaged drafter (`package://NAME`) is named by its directory: `package://../../etc` or
    `package:///etc` would reach outside the drafters directory."""
    if source.startswith(PACKAGE_SCHEME) and not PACKAGED_DRAFTER_NAME.match(
        source.removeprefix(PACKAGE_SCHEME)
    ):
        raise ValueError(
            f"`{source}`: a packaged drafter is named by its directory under "
            "specserve/drafters (letters, digits, '.', '_', '-'; no path)"
        )


class NoSpeculation(_Strict):
    method: Literal["none"] = Field(description="Plain decoding, the baseline arm.")


class _Drafting(_Strict):
    """What every drafting method takes: k, and optionally k by batch size."""

    num_speculative_tokens: int = Field(
        gt=0, le=16, description="Draft tokens per step (k); the most a schedule may use."
    )
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = Field(
        None,
        description="k by load: inclusive batch-size ranges [first, last, k], the first "
        "starting at 1, k from 0 (no drafts) to `num_speculative_tokens`; the last range's k "
        "holds beyond it. vLLM's dynamic speculative decoding picks each step's k by the "
        "requests in it. `specserve tune` measures and writes it (docs/config.md).",
    )

    @model_validator(mode="after")
    def _schedule_fits(self) -> _Drafting:
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is not None:
            found = k_schedule.problem(schedule, self.num_speculative_tokens)
            if found:
                raise ValueError(f"num_speculative_tokens_per_batch_size: {found}")
        return self


class NgramSpeculation(_Drafting):
    method: Literal["ngram"] = Field(description="Prompt-lookup drafting (no draft model).")
    prompt_lookup_max: int = Field(4, gt=0, description="Longest n-gram matched in the prompt.")
    prompt_lookup_min: int = Field(2, gt=0, description="Shortest n-gram matched in the prompt.")

    @model_validator(mode="after")
    def _lookup_range(self) -> NgramSpeculation:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class Eagle3Speculation(_Drafting):
    # Keys specserve's engine reads itself; vLLM's speculative_config is the rest.
    platform_keys: ClassVar[frozenset[str]] = frozenset(
        {"skip_drafter_at_k0", "prompt_lookup_first"}
    )

    method: Literal["eagle3"] = Field(
        description="EAGLE-3 drafter; EAGLE-3.1 checkpoints (fc_norm, norm_output) use it too."
    )
    model: str = Field(
        description="Drafter checkpoint directory or hub id, or `package://NAME` for a drafter "
        "shipped with specserve (a directory under specserve/drafters)."
    )
    skip_drafter_at_k0: bool = Field(
        True,
        description="At a step whose k is 0 (num_speculative_tokens_per_batch_size), skip the "
        "drafter's pass over the step's tokens. vLLM runs it so the drafter's KV cache has no "
        "gaps when drafting resumes; skipping it makes a step at k = 0 cost what a step "
        "without speculation does, for a slightly lower acceptance in the steps that draft "
        "again (docs/config.md). CPU engines; GPU engines always run the pass.",
    )
    prompt_lookup_first: int | None = Field(
        None,
        ge=1,
        le=8,
        description="Draft by prompt lookup first: where the request's last N or more tokens "
        "(N this value) occurred earlier in its prompt or output, draft the tokens that "
        "followed them there (the `ngram` arm's lookup) instead of the drafter's guesses; "
        "elsewhere the drafter drafts. Copying is what the drafter does worst (answers that "
        "repeat names, code or documents); output is unchanged (docs/config.md). CPU engines; "
        "null: the drafter alone.",
    )
    revision: str | None = Field(
        None,
        pattern=COMMIT_PATTERN,
        description="The commit of the drafter's hub repository that the engines load (40 hex "
        "digits). Required where the arm sets trust_remote_code and `model` is a hub id.",
    )
    use_local_argmax_reduction: bool = Field(
        True,
        description="vLLM's: each draft token is the argmax of the drafter's own (smaller) "
        "vocabulary, mapped to the target's, instead of the argmax of its logits scattered into "
        "a full-vocabulary tensor. The same drafts; on an engine's one CPU core it takes 26-33 % "
        "off the drafter's pass at 4-8 requests (docs/bench/serving-speed.md). false: vLLM's "
        "default.",
    )

    @field_validator("model")
    @classmethod
    def _packaged_drafter_named_by_its_directory(cls, model: str) -> str:
        check_packaged_drafter_name(model)
        return model

    @model_validator(mode="after")
    def _revision_pins_a_hub_repository(self) -> Eagle3Speculation:
        check_pin(self.model, self.revision)
        return self


Speculation = Annotated[
    NoSpeculation | NgramSpeculation | Eagle3Speculation, Field(discriminator="method")
]


class CodeLoadingOptIn(_Strict):
    engine: list[str] = Field(
        default_factory=list,
        description="`engine` settings outside the allow-list this arm may use (e.g. "
        "trust_remote_code, for a model whose code ships with its checkpoint).",
    )
    env: list[str] = Field(
        default_factory=list,
        description="`env` variables outside the allow-list this arm may set (e.g. LD_PRELOAD).",
    )
    drafter: bool = Field(
        False,
        description="With `trust_remote_code`, vLLM also runs the Python code that ships with "
        "the drafter's checkpoint (it passes the target's flag on to the draft model): true "
        "says the operator takes responsibility for that code too.",
    )


class ArmEngineConfig(_Strict):
    """What runs for one arm: everything but its traffic weight. A change to its engine
    (`speculative`, `engine`, `env`) restarts the arm's engine replicas; replicas and queue
    bounds (`DEPLOYMENT_OPTIONS`) apply to the running ones. The weight lives in `ArmConfig`
    and changes live in the router."""

    # The chart's values.schema.json refuses settings outside the allow-lists, too.
    model_config = ConfigDict(json_schema_extra=policy.opt_in_schema())

    name: str = Field(
        pattern=ARM_NAME_PATTERN,
        description="Arm name: lower-case letters, digits, '.', '-'; used in metrics and headers.",
    )
    speculative: Speculation = Field(
        default_factory=lambda: NoSpeculation(method="none"),
        description="The draft configuration this arm serves.",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="Engine replicas of this arm. At most 1024: each is an engine with its own "
        "GPUs or pod, and a typo must not ask the cluster for millions.",
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Requests one engine replica works on at once (vLLM batches them); the "
        "rest wait in the HTTP proxy. Default: the engine's `max_num_seqs`, else 256. At most "
        "100000, far beyond any engine's batch: the arm's capacity must stay a bound.",
    )
    max_queued_requests: int = Field(
        64,
        ge=1,
        le=100_000,
        description="Requests each HTTP proxy (one per Ray node) holds for this arm while its "
        "engines are full; beyond that a request gets 429 with Retry-After at once. At most "
        "100000: each waiting request holds its body and a connection in the proxy.",
    )
    max_surge_percent: int = Field(
        0,
        ge=0,
        le=100,
        description="Extra engine replicas, as a percentage of `replicas` (rounded up), that "
        "may start while an engine change replaces this arm's replicas: with 100 the old ones "
        "serve until their replacements run (no downtime, if the cluster has room for them); "
        "with 0 they stop first.",
    )
    drafter_weights: str | None = Field(
        None,
        description="A drafter checkpoint with the tensors of `speculative.model`'s (the same "
        "names and shapes, e.g. one `specserve drafter adapt` trained from it), whose weights "
        "the running engines load in place, without a restart; null: `speculative.model`'s "
        "own. A directory on the engines' nodes or `package://NAME`. `specserve loop` promotes "
        "a candidate this way.",
    )
    allow_code_loading: CodeLoadingOptIn = Field(
        default_factory=CodeLoadingOptIn,
        description="Engine settings and environment variables outside the allow-lists that "
        "this arm may use, each by name: the operator takes responsibility for the code they "
        "load.",
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine arguments from the allow-list (e.g. dtype, "
        "enforce_eager, max_num_seqs; docs/config.md), others only by `allow_code_loading`.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of the engine processes from the allow-list "
        "(OMP_*, VLLM_CPU_KVCACHE_SPACE, ...; docs/config.md), others only by "
        "`allow_code_loading`.",
    )

    def ongoing_per_replica(self) -> int:
        """Requests one engine replica takes at once: `max_ongoing_requests`, else what the
        engine batches."""
        return self.max_ongoing_requests or int(
            self.engine.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        )

    def capacity_per_proxy(self) -> int:
        """The most requests one HTTP proxy has at this arm at once: every replica full with
        its requests, and its own queue for the arm full."""
        return self.replicas * self.ongoing_per_replica() + self.max_queued_requests

    @field_validator("engine")
    @classmethod
    def _engine_keys_owned_elsewhere(cls, engine: dict[str, Any]) -> dict[str, Any]:
        owned = {
            "speculative_config": "speculative",
            "model": "model.source",
            "max_model_len": "model.max_model_len",
            "served_model_name": "model.name",
            # One pin for weights, tokenizer and code: the model's (vLLM's revision for the
            # drafter is `speculative.revision`).
            **dict.fromkeys(MODEL_REVISION_ARGS, "model.revision"),
        }
        for key, where in owned.items():
            if key in engine:
                raise ValueError(f"`{key}` is set by `{where}`, not under `engine`")
        return engine

    @field_validator("engine")
    @classmethod
    def _engine_settings_allowed(
        cls, engine: dict[str, Any], info: ValidationInfo
    ) -> dict[str, Any]:
        allowed = info.data.get("allow_code_loading")
        opted_in = set(allowed.engine) if allowed is not None else set()
        for key, value in engine.items():
            problem = policy.non_finite(value, key)
            if problem is None and key not in opted_in:
                problem = policy.engine_refusal(key, value)
            if problem:
                raise ValueError(problem)
        return engine

    @field_validator("env")
    @classmethod
    def _env_allowed(cls, env: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        allowed = info.data.get("allow_code_loading")
        opted_in = set(allowed.env) if allowed is not None else set()
        for name in env:
            if not policy.ENV_NAME_PATTERN.match(name):
                raise ValueError(f"`{name}` is not an environment variable name")
            problem = None if name in opted_in else policy.env_refusal(name)
            if problem:
                raise ValueError(problem)
        return env

    @model_validator(mode="after")
    def _drafter_weights_fit_an_eagle_arm(self) -> ArmEngineConfig:
        weights = self.drafter_weights
        if weights is None:
            return self
        if self.speculative.method != "eagle3":
            raise ValueError(
                "`drafter_weights` replaces an EAGLE drafter's weights: this arm has none"
            )
        check_packaged_drafter_name(weights)
        if not weights.startswith((PACKAGE_SCHEME, "/")):
            raise ValueError(
                f"`drafter_weights: {weights}`: an absolute directory or `package://NAME` (the "
                "engines read it in place; a hub repository goes in `speculative.model`)"
            )
        return self

    @model_validator(mode="after")
    def _opt_ins_name_what_is_set(self) -> ArmEngineConfig:
        # An opt-in stays beside the setting it allows: a stale one would allow that setting
        # silently the next time someone adds it.
        allowed = self.allow_code_loading
        for section, names in (("engine", allowed.engine), ("env", allowed.env)):
            unset = sorted(set(names) - set(getattr(self, section)))
            if unset:
                raise ValueError(
                    f"`allow_code_loading.{section}` names {', '.join(unset)}, which this arm's "
                    f"`{section}` does not set"
                )
        drafter = getattr(self.speculative, "model", None)
        if self.engine.get("trust_remote_code") and drafter and not allowed.drafter:
            raise ValueError(
                f"with trust_remote_code vLLM also runs the code that ships with the drafter "
                f"{drafter}: say so with `allow_code_loading: {{drafter: true}}` on this arm"
            )
        return self


class CaptureConfig(_Strict):
    """Capture of this arm's traffic, to adapt drafters from (docs/capture.md)."""

    sample: float = Field(
        gt=0,
        le=1,
        description="Share of the arm's requests whose prompt and output token ids are kept "
        "(0.05: one in twenty).",
    )
    max_records: int = Field(
        100_000,
        ge=10,
        le=100_000_000,
        description="Most records each engine replica keeps; the oldest are deleted first.",
    )
    max_age_s: float = Field(
        7 * 86_400,
        gt=0,
        le=365 * 86_400,
        description="Records older than this are deleted (a week by default; at most a year).",
    )
    max_bytes: int = Field(
        DEFAULT_MAX_BYTES,
        ge=1 << 20,
        le=1 << 40,
        description="Most bytes of records each engine replica keeps on disk (1 GiB by "
        "default); the oldest are deleted first, and a record over a tenth of it is dropped.",
    )


# An arm's settings the router applies itself, live: no engine is touched when they change.
ROUTER_SIDE = ("weight", "capture")


class ArmConfig(ArmEngineConfig):
    capture: CaptureConfig | None = Field(
        None,
        description="Keep a sample of this arm's requests (prompt and output token ids) to "
        "adapt drafters from; null = off. A client opts a request out with "
        "`x-specserve-no-capture: 1`, a key with `limits.per_key.<name>.capture: false`.",
    )
    weight: float = Field(
        ge=0,
        le=1e6,
        description="Relative share of un-pinned traffic; 0 = none. At most 1e6: shares are "
        "relative, and their sum must stay a precise finite number.",
    )

    def engine_args(self) -> dict[str, Any]:
        """The engine part as plain data, only the keys the config sets (for the Serve config:
        a default that changes upstream must not redeploy an arm nobody touched)."""
        return self.model_dump(
            mode="json",
            exclude_unset=True,
            exclude={*ROUTER_SIDE, *DEPLOYMENT_OPTIONS, *RELOADED_IN_PLACE},
        )

    def deployment_options(self) -> dict[str, Any]:
        """The replica and queue settings the config sets, as Ray Serve deployment options, and
        an EAGLE arm's drafter weights as its `user_config` (always there, null included: a
        replica is told to go back to its own drafter's weights, as Ray Serve calls no
        `reconfigure` once `user_config` is gone)."""
        found = self.model_dump(mode="json", exclude_unset=True, include=set(DEPLOYMENT_OPTIONS))
        options = {DEPLOYMENT_OPTIONS[key]: value for key, value in found.items()}
        if self.speculative.method == "eagle3":
            options["user_config"] = {key: getattr(self, key) for key in RELOADED_IN_PLACE}
        return options


# A request's prompt digest (wire/requests.py): 16 hex digits.
PromptDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16}$")]
# ~23 bytes a digest in the config's YAML, ~460 KB: a revision stays within a 1 MiB ConfigMap.
MAX_LEFT_OUT_PROMPTS = 20_000


class RoutingConfig(_Strict):
    session_header: str = Field(
        "x-session-id",
        description="Request header (lower case) whose value pins a client session to one arm; "
        "not one that carries credentials or that the platform sets itself.",
    )
    use_user_field: bool = Field(
        True, description="Use the OpenAI `user` field as the sticky key when no session header."
    )
    arm_header: Literal["admin", "everyone"] = Field(
        "admin",
        description=f"Who is told which arm answered (`{headers.ARM}`): `admin` keys only "
        "(everyone where no API keys are configured), or `everyone`. A client told its arm can "
        "try sticky keys until it lands on the arm it wants.",
    )
    replay_on_another_arm: bool = Field(
        False,
        description="Replay a weighted or sticky request whose arm's replica died before "
        "answering on another running arm. Off (the default): on its own arm, where Ray Serve "
        "routes it to another replica, or holds it until the dead one's replacement runs "
        "(minutes for an engine). On: no wait where an arm has one replica, but a request that "
        "kills engines kills one on each of two arms.",
    )

    max_key_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="The most of an arm's A/B statistics and acceptance guardrail one API key may "
        "make: among any `key_share_window` consecutive requests counted for an arm, at most this "
        "share from one key; the rest of its requests are served but counted nowhere. null (the "
        "default): every weighted and sticky request counts. With fewer active keys than "
        "1 / share the statistics grow only as fast as the other keys send.",
    )
    key_share_window: int = Field(
        200,
        ge=10,
        le=1_000_000,
        description="Counted requests per arm over which `max_key_share` is held.",
    )
    ab_left_out_prompts: frozenset[PromptDigest] = Field(
        frozenset(),
        max_length=MAX_LEFT_OUT_PROMPTS,
        description="Digests of prompts (wire/requests.py `prompt_digest`: the same for repeats "
        "that differ in case, spacing or numbers) whose requests are served but left out of "
        "the A/B statistics on every arm, and counted apart: what a challenger was trained on. "
        "`specserve loop` sets it with its challenger and removes it after.",
    )

    def names_arm_to(self, admin: bool) -> bool:
        """Whether an answer to a client (an admin key or not) carries the arm's name."""
        return self.arm_header == "everyone" or admin

    @field_validator("session_header")
    @classmethod
    def _header_can_pin_sessions(cls, name: str) -> str:
        if not HEADER_NAME_PATTERN.match(name):
            raise ValueError(
                f"`{name}` is not a lower-case HTTP header name (a token of letters, digits and "
                "'-', at most 64 characters)"
            )
        if name in UNSTICKY_HEADERS:
            raise ValueError(f"`{name}` {UNSTICKY_HEADERS[name]}")
        if name.startswith(headers.INTERNAL_PREFIX):
            raise ValueError(f"`{name}`: `{headers.INTERNAL_PREFIX}*` headers are the platform's")
        return name


class KeyLimit(_Strict):
    requests_per_minute: float | None = Field(
        None,
        gt=0,
        le=1e9,
        description="Requests one API key may send per minute; null = no limit.",
    )
    capture: bool = Field(
        True,
        description="false: no request of this key is captured, whatever the arm's `capture`.",
    )
    output_tokens_per_minute: float | None = Field(
        None,
        gt=0,
        le=1e12,
        description="Output tokens one API key may have generated per minute; a request waits "
        "(429 with Retry-After) while the key is over it. null = no limit.",
    )


# The `limits.per_key` entry for every key not named there.
ANY_KEY = "*"


# The largest `limits.max_tokens`: longer than any model's context.
MAX_TOKENS_BOUND = 1 << 20


class LimitsConfig(_Strict):
    max_tokens: int = Field(
        2048,
        gt=0,
        le=MAX_TOKENS_BOUND,
        description="Largest `max_tokens` a request may ask for; more is a 400. A request "
        "that names none gets this many at most.",
    )
    max_n: int = Field(
        16,
        gt=0,
        le=128,
        description="Largest `n` (choices per request) a request may ask for; more is a 400. "
        "At most 128: each choice is a sequence in the engine's batch.",
    )
    max_body_bytes: int = Field(
        1_000_000,
        gt=0,
        le=100_000_000,
        description="Largest request body accepted; more is a 413. At most 100 MB: a body is "
        "held in memory whole before it is parsed.",
    )
    request_timeout_s: float = Field(
        600,
        gt=0,
        le=MAX_REQUEST_TIMEOUT_S,
        description="A request still running after this long is cancelled (504). At most a "
        "day: a request holds an engine slot and a connection until then.",
    )
    max_total_tokens: int = Field(
        16384,
        gt=0,
        le=MAX_TOKENS_BOUND,
        description="Largest prompts x `n` x `max_tokens` (every answer's tokens) of one "
        "request; more is a 400.",
    )
    body_timeout_s: float = Field(
        30,
        gt=0,
        le=3600,
        description="A request body still arriving after this long is refused (408): a slow "
        "client cannot hold a connection and its buffer open. At most an hour.",
    )
    prefix_cache_per_key: bool = Field(
        False,
        description="Give each API key a prefix cache of its own (vLLM's `cache_salt`, set by "
        "the router; a client's own is replaced): no key can tell from an answer's speed what "
        "another key's prompts began with. Costs the sharing of common prefixes (a system "
        "prompt) between keys.",
    )
    per_key: dict[str, KeyLimit] = Field(
        default_factory=dict,
        description="Rate limits (counted in each HTTP proxy, one per Ray node) and capture "
        "opt-outs by API key name (`*`: every key not named).",
    )

    def key_limit(self, name: str) -> KeyLimit | None:
        return self.per_key.get(name, self.per_key.get(ANY_KEY))


class GuardrailConfig(_Strict):
    min_acceptance_length: float | None = Field(
        None,
        ge=1,
        le=17,
        description="Drain a speculative arm whose mean acceptance length over the window falls "
        "below this (e.g. a drafter that does not match the target); null = off. At most 17 "
        "(1 + the largest k): a higher floor drains every arm.",
    )
    window_s: float = Field(
        60,
        gt=0,
        le=86_400,
        description="Seconds of traffic the mean is taken over. At most a day: the router "
        "keeps the window's requests in memory.",
    )
    min_drafts: int = Field(
        200, ge=1, description="Verify steps the window needs before the arm is judged."
    )
    drain_s: float = Field(
        300,
        gt=0,
        le=86_400,
        description="How long a drained arm gets no weighted or sticky traffic; then it takes "
        "traffic again and is judged afresh (the override header reaches it throughout). At "
        "most a day: to keep an arm out for longer, give it weight 0.",
    )


class RouterConfig(_Strict):
    model: ModelConfig = Field(description="The target model every arm serves.")
    arms: list[ArmConfig] = Field(min_length=1, description="The draft configurations compared.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="Stickiness.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    guardrail: GuardrailConfig = Field(
        default_factory=GuardrailConfig, description="Acceptance-collapse detection per arm."
    )

    @field_validator("arms")
    @classmethod
    def _arms_valid(cls, arms: list[ArmConfig]) -> list[ArmConfig]:
        names = [arm.name for arm in arms]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate arm names: {duplicates}")
        if not any(arm.weight > 0 for arm in arms):
            raise ValueError("at least one arm needs weight > 0")
        return arms

    @model_validator(mode="after")
    def _code_comes_from_pinned_commits(self) -> RouterConfig:
        for arm in self.arms:
            problem = unpinned_code(self.model, arm)
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _prompt_lookup_on_cpu_engines(self) -> RouterConfig:
        # The lookup swaps drafts where a CPU engine's core takes them; a GPU engine's
        # scheduling never passes there, so the key would do nothing (docs/config.md).
        for arm in self.arms:
            if getattr(arm.speculative, "prompt_lookup_first", None) is not None and (
                self.model.accelerator != "cpu"
            ):
                raise ValueError(
                    f"arm {arm.name!r}: speculative.prompt_lookup_first needs "
                    "model.accelerator: cpu"
                )
        return self

    def arm(self, name: str) -> ArmConfig | None:
        return next((arm for arm in self.arms if arm.name == name), None)

    @property
    def weights(self) -> dict[str, float]:
        return {arm.name: arm.weight for arm in self.arms}

    @property
    def k_by_arm(self) -> dict[str, list[tuple[str, int]]]:
        """Each arm's k per range of batch sizes, labelled as metrics show them."""
        return {arm.name: k_schedule.ranges_of(arm.speculative) for arm in self.arms}


class LoadedConfig(BaseModel):
    """A validated config with the revision of the bytes it came from."""

    model_config = ConfigDict(frozen=True)

    config: RouterConfig
    revision: str
    path: str


def revision_of(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:12]


def parse_config(raw: bytes | str, *, source: str = "<config>") -> RouterConfig:
    """Parse and validate one YAML document; ConfigError names the file and the bad field."""
    try:
        data = load_yaml(raw)
    except RefusedDocument as exc:
        raise ConfigError(f"{source}: refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_describe(exc)}") from None


def read_config_file(path: str | Path) -> bytes:
    """The file's bytes; one larger than MAX_CONFIG_BYTES is refused without reading it all."""
    try:
        with Path(path).open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: refused: more than {MAX_CONFIG_BYTES} bytes")
    return raw


def load_config(path: str | Path) -> LoadedConfig:
    raw = read_config_file(path)
    config = parse_config(raw, source=str(path))
    return LoadedConfig(config=config, revision=revision_of(raw), path=str(path))


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"`{where}`: {message}")
    return "; ".join(problems)
