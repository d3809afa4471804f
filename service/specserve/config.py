"""Router config: the schema of the YAML document, loading, and the revision hash.

One document describes the public model, the arms (draft configurations) with their weights, how
requests stick to arms, and request limits. Its revision is a hash of the file's bytes, so the
same file always has the same revision and a rollback restores the old revision exactly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ARM_NAME_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,40}[a-z0-9])?$"
# An arm's settings that Ray Serve applies to its running engine replicas without restarting
# them, by their Ray Serve deployment option name (serve_config.py passes them as such).
DEPLOYMENT_OPTIONS = {
    "replicas": "num_replicas",
    "max_ongoing_requests": "max_ongoing_requests",
    "max_queued_requests": "max_queued_requests",
    "max_surge_percent": "max_surge_percent",
}
# vLLM's own `max_num_seqs` default: what an engine batches when the arm does not say.
DEFAULT_MAX_NUM_SEQS = 256
# Keys that moved; the error for an old key names its replacement.
RENAMED_KEYS = {"num_draft_tokens": "num_speculative_tokens", "draft_model": "model"}


class ConfigError(ValueError):
    """A config document that cannot be served; the message names the bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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


class NoSpeculation(_Strict):
    method: Literal["none"] = Field(description="Plain decoding, the baseline arm.")


class NgramSpeculation(_Strict):
    method: Literal["ngram"] = Field(description="Prompt-lookup drafting (no draft model).")
    num_speculative_tokens: int = Field(gt=0, le=16, description="Draft tokens per step (k).")
    prompt_lookup_max: int = Field(4, gt=0, description="Longest n-gram matched in the prompt.")
    prompt_lookup_min: int = Field(2, gt=0, description="Shortest n-gram matched in the prompt.")

    @model_validator(mode="after")
    def _lookup_range(self) -> NgramSpeculation:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


class Eagle3Speculation(_Strict):
    method: Literal["eagle3"] = Field(
        description="EAGLE-3 drafter; EAGLE-3.1 checkpoints (fc_norm, norm_output) use it too."
    )
    model: str = Field(description="Drafter checkpoint directory or hub id.")
    num_speculative_tokens: int = Field(gt=0, le=16, description="Draft tokens per step (k).")


Speculation = Annotated[
    NoSpeculation | NgramSpeculation | Eagle3Speculation, Field(discriminator="method")
]


class ArmEngineConfig(_Strict):
    """What runs for one arm: everything but its traffic weight. A change to its engine
    (`speculative`, `engine`, `env`) restarts the arm's engine replicas; replicas and queue
    bounds (`DEPLOYMENT_OPTIONS`) apply to the running ones. The weight lives in `ArmConfig`
    and changes live in the router."""

    name: str = Field(
        pattern=ARM_NAME_PATTERN,
        description="Arm name: lower-case letters, digits, '.', '-'; used in metrics and headers.",
    )
    speculative: Speculation = Field(
        default_factory=lambda: NoSpeculation(method="none"),
        description="The draft configuration this arm serves.",
    )
    replicas: int = Field(1, ge=1, description="Engine replicas of this arm.")
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests one engine replica works on at once (vLLM batches them); the "
        "rest wait in the HTTP proxy. Default: the engine's `max_num_seqs`, else 256.",
    )
    max_queued_requests: int = Field(
        64,
        ge=1,
        description="Requests each HTTP proxy (one per Ray node) holds for this arm while its "
        "engines are full; beyond that a request gets 429 with Retry-After at once.",
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
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine arguments (e.g. dtype, enforce_eager, max_num_seqs).",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables of the engine processes."
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
        }
        for key, where in owned.items():
            if key in engine:
                raise ValueError(f"`{key}` is set by `{where}`, not under `engine`")
        return engine


class ArmConfig(ArmEngineConfig):
    weight: float = Field(ge=0, description="Relative share of un-pinned traffic; 0 = none.")

    def engine_args(self) -> dict[str, Any]:
        """The engine part as plain data, only the keys the config sets (for the Serve config:
        a default that changes upstream must not redeploy an arm nobody touched)."""
        return self.model_dump(
            mode="json", exclude_unset=True, exclude={"weight", *DEPLOYMENT_OPTIONS}
        )

    def deployment_options(self) -> dict[str, Any]:
        """The replica and queue settings the config sets, as Ray Serve deployment options."""
        found = self.model_dump(mode="json", exclude_unset=True, include=set(DEPLOYMENT_OPTIONS))
        return {DEPLOYMENT_OPTIONS[key]: value for key, value in found.items()}


class RoutingConfig(_Strict):
    session_header: str = Field(
        "x-session-id",
        description="Request header whose value pins a client session to one arm.",
    )
    use_user_field: bool = Field(
        True, description="Use the OpenAI `user` field as the sticky key when no session header."
    )


class LimitsConfig(_Strict):
    max_tokens: int = Field(
        2048, gt=0, description="Largest `max_tokens` a request may ask for; more is a 400."
    )
    max_n: int = Field(
        16,
        gt=0,
        description="Largest `n` (choices per request) a request may ask for; more is a 400.",
    )
    max_body_bytes: int = Field(
        1_000_000, gt=0, description="Largest request body accepted; more is a 413."
    )
    request_timeout_s: float = Field(
        600, gt=0, description="A request still running after this long is cancelled (504)."
    )


class GuardrailConfig(_Strict):
    min_acceptance_length: float | None = Field(
        None,
        ge=1,
        description="Drain a speculative arm whose mean acceptance length over the window falls "
        "below this (e.g. a drafter that does not match the target); null = off.",
    )
    window_s: float = Field(60, gt=0, description="Seconds of traffic the mean is taken over.")
    min_drafts: int = Field(
        200, ge=1, description="Verify steps the window needs before the arm is judged."
    )
    drain_s: float = Field(
        300,
        gt=0,
        description="How long a drained arm gets no weighted or sticky traffic; then it takes "
        "traffic again and is judged afresh (the override header reaches it throughout).",
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

    def arm(self, name: str) -> ArmConfig | None:
        return next((arm for arm in self.arms if arm.name == name), None)

    @property
    def weights(self) -> dict[str, float]:
        return {arm.name: arm.weight for arm in self.arms}


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
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_describe(exc)}") from None


def read_config_file(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None


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
