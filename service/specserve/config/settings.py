"""Process settings from the environment: the one place `SPECSERVE_*` variables are read."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_CONFIG_PATH = Path(__file__).parents[1] / "configs" / "default.yaml"
ENV_PREFIX = "SPECSERVE_"
# Read by the arms' engine replicas, in processes Ray starts: a local cluster inherits it.
CAPTURE_DIR_ENV = f"{ENV_PREFIX}CAPTURE_DIR"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    config: Path = Field(
        DEFAULT_CONFIG_PATH,
        description="Router config YAML; in Kubernetes a file mounted from a ConfigMap.",
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "specserve",
        description="Where prepared models and other derived artefacts are kept.",
    )
    capture_dir: Path | None = Field(
        None,
        description="Where arms keep their capture samples (docs/capture.md); on Kubernetes a "
        "mounted volume. Unset: `<cache_dir>/capture`.",
    )
    host: str = Field("127.0.0.1", description="Address the OpenAI endpoint listens on.")
    port: int = Field(8000, description="Port of the OpenAI endpoint (Ray Serve HTTP proxy).")
    metrics_port: int = Field(
        9464,
        description="Metrics export port of a local Ray cluster: the router, vLLM and Ray Serve "
        "metrics of this node, in Prometheus format at /metrics.",
    )
    router_replicas: int = Field(
        1,
        ge=1,
        description="Replicas of the router application (`/ready`, `/v1/models`, "
        "`/openapi.json`); inference requests are routed in the HTTP proxies.",
    )
    config_poll_s: float = Field(
        1.0, gt=0, description="How often the config file is checked for a new revision."
    )
    expose_arms: bool = Field(
        False,
        description="Let clients reach each arm's own routes, bypassing the router: its OpenAI "
        "front under /arms/<name>/v1 and vLLM's own OpenAI server under /arms/<name>/vllm/v1 "
        "(debugging; the router-overhead benchmark compares the router with the latter).",
    )
    api_keys_file: Path | None = Field(
        None,
        description="File of the API keys clients must send (`Authorization: Bearer KEY`): one "
        "key a line, `name=key` or a bare key, `#` comments; re-read when it changes. Unset: "
        "no keys, allowed only on a loopback address (see `allow_unauthenticated`).",
    )
    admin_keys_file: Path | None = Field(
        None,
        description="File of the admin keys, in the same format: they may also force an arm "
        "(`x-specserve-arm`). An admin key is an API key too.",
    )
    sticky_salt_file: Path | None = Field(
        None,
        description="File of a secret (any bytes) that salts the hash of sticky keys, so that "
        "no client can work out which session id or `user` lands on which arm. Unset: "
        "unsalted. Every proxy of a deployment must read the same one.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve without API keys on a non-loopback address (refused otherwise).",
    )
    stop_drain_s: float = Field(
        10.0,
        ge=0,
        description="On Ctrl-C or SIGTERM, how long requests in flight (streams included) get "
        "to finish while new ones are refused with 503, before a local platform stops.",
    )
    ray_address: str | None = Field(
        None, description="Join this Ray cluster instead of starting a local one."
    )
    ray_num_cpus: int = Field(
        16,
        description="Logical CPUs of a local Ray cluster. Each engine replica asks for 2, so a "
        "2-core machine needs more logical than physical CPUs.",
    )

    def capture_path(self) -> Path:
        return self.capture_dir or self.cache_dir / "capture"


@lru_cache
def get_settings() -> Settings:
    return Settings()
