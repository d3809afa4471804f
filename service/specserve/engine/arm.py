"""Build the Ray Serve LLM application that serves one arm.

Each arm is its own Serve application (`arm-<name>`, see serve_config.py), so adding, changing or
removing one arm redeploys that arm only. Its replicas answer HTTP under the arm's route with
specserve's OpenAI front (engine/front.py), where the dispatch in each HTTP proxy sends the
requests it routes to the arm.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig, build_llm_deployment

from specserve.config.schema import (
    MAX_REQUEST_TIMEOUT_S,
    MODEL_REVISION_ARGS,
    ArmEngineConfig,
    ModelConfig,
    unpinned_code,
)
from specserve.config.serve_config import (
    ARM_ARG,
    ARM_NAME_ENV,
    EXPOSE_HTTP_ARG,
    MODEL_ARG,
    arm_app_name,
)
from specserve.engine import drafter_reload, vllm_fixes
from specserve.engine.front import ArmServer
from specserve.engine.node_init import SkipNodeInitWithoutBucket
from specserve.hardware import fast_dtype
from specserve.models import resolve_drafter_source, resolve_model_source
from specserve.wire.errors import OVERLOAD_RETRY_AFTER_S, OVERLOAD_STATUS

# Engine defaults for every arm; the arm's own `engine` settings win.
ENGINE_DEFAULTS: dict[str, Any] = {
    # Per-request acceptance in the response body lets the router attribute it to the arm.
    "per_request_spec_decode_metrics": "summary",
}


def deployment_config(arm: ArmEngineConfig) -> dict[str, Any]:
    """Ray Serve options of the arm's engine deployment: replicas and bounded queues. An engine
    replica takes what it can batch; the excess waits in each HTTP proxy's queue for the arm,
    and beyond that is refused at once instead of waiting without bound. The builder's args
    leave out the replica and queue settings the config sets: those reach Ray Serve as options
    of the deployment in the Serve config (config/serve_config.py) and win over these defaults."""
    return {
        "num_replicas": arm.replicas,
        "max_ongoing_requests": arm.ongoing_per_replica(),
        "max_queued_requests": arm.max_queued_requests,
        "backpressure_config": {
            "status_code": OVERLOAD_STATUS,
            "retry_after_s": OVERLOAD_RETRY_AFTER_S,
        },
        # A replica being stopped (a redeploy, or a drained node's replica once its replacement
        # runs) finishes its requests first, however long they may run: each ends by its own
        # timeout (Ray Serve's default, 20 s, cut streams in the middle).
        "graceful_shutdown_timeout_s": MAX_REQUEST_TIMEOUT_S,
    }


# Every device of one engine (tensor parallel 4 on a GB200 tray) on one node: Ray Serve LLM's
# default, PACK, places what does not fit on another node, where the GPUs share no NVLink.
PLACEMENT_STRATEGY = "STRICT_PACK"
# One bundle per tensor parallel worker, as Ray Serve LLM's default for each accelerator.
WORKER_BUNDLE = {"gpu": {"GPU": 1}, "cpu": {"CPU": 1}}


def placement_group_config(model: ModelConfig) -> dict[str, Any]:
    return {"bundle_per_worker": WORKER_BUNDLE[model.accelerator], "strategy": PLACEMENT_STRATEGY}


def speculative_config(arm: ArmEngineConfig) -> dict[str, Any] | None:
    spec = arm.speculative
    if spec.method == "none":
        return None
    # Without a schedule the key stays out: vLLM's own default, and the Serve config of an arm
    # that never had one unchanged (no redeploy).
    platform_keys: frozenset[str] = getattr(spec, "platform_keys", frozenset())
    config = spec.model_dump(exclude={"num_speculative_tokens_per_batch_size", *platform_keys})
    if spec.num_speculative_tokens_per_batch_size is not None:
        config["num_speculative_tokens_per_batch_size"] = [
            list(entry) for entry in spec.num_speculative_tokens_per_batch_size
        ]
    if spec.method == "eagle3":
        config["model"] = resolve_drafter_source(spec.model)
        if spec.revision is None:
            config.pop("revision")
        else:  # vLLM loads the drafter's code (trust_remote_code) by its own revision
            config["code_revision"] = spec.revision
    return config


def engine_kwargs(arm: ArmEngineConfig, model: ModelConfig) -> dict[str, Any]:
    """The vLLM engine arguments of an arm's engine, but the model (as `LLM(model, **these)`
    takes them): what its replicas run, and what `bench.round_cost` measures."""
    engine_kwargs: dict[str, Any] = {**ENGINE_DEFAULTS, **arm.engine}
    spec = speculative_config(arm)
    if spec is None:
        # vLLM refuses per-request spec-decode metrics without a draft configuration.
        engine_kwargs.pop("per_request_spec_decode_metrics", None)
    else:
        engine_kwargs["speculative_config"] = spec
        if spec["method"] == "eagle3":  # its drafter's weights can be swapped in place
            engine_kwargs["worker_extension_cls"] = drafter_reload.WORKER_EXTENSION
        if "num_speculative_tokens_per_batch_size" in spec and (
            "per_request_spec_decode_metrics" not in arm.engine
        ):
            # Each verify step's draft length, so acceptance per position is counted over the
            # drafts that reached it when k varies (metrics.py).
            engine_kwargs["per_request_spec_decode_metrics"] = "detailed"
    if model.max_model_len is not None:
        engine_kwargs["max_model_len"] = model.max_model_len
    if model.revision is not None:  # the weights, the tokenizer and the code: one commit
        engine_kwargs.update(dict.fromkeys(MODEL_REVISION_ARGS, model.revision))
    if model.accelerator == "cpu":  # bf16 only where the CPU has bf16 instructions
        engine_kwargs.setdefault("dtype", fast_dtype())
    return engine_kwargs


def engine_env(arm: ArmEngineConfig) -> dict[str, str]:
    """The environment of an arm's engine processes: its own `env`, and the settings that
    specserve's vLLM plugin (vllm_fixes.py) reads there."""
    env = dict(arm.env)
    if getattr(arm.speculative, "skip_drafter_at_k0", False):
        env[vllm_fixes.SKIP_DRAFTER_AT_K0_ENV] = "1"
    lookup_first = getattr(arm.speculative, "prompt_lookup_first", None)
    if lookup_first is not None:
        env[vllm_fixes.PROMPT_LOOKUP_FIRST_ENV] = str(lookup_first)
    return env


def build_llm_config(arm: ArmEngineConfig, model: ModelConfig) -> LLMConfig:
    return LLMConfig(
        model_loading_config={
            "model_id": model.name,
            "model_source": resolve_model_source(model.source),
        },
        engine_kwargs=engine_kwargs(arm, model),
        runtime_env={"env_vars": {**engine_env(arm), ARM_NAME_ENV: arm.name}},
        accelerator_config={"kind": model.accelerator},  # type: ignore[arg-type]  # validated
        placement_group_config=placement_group_config(model),
        deployment_config=deployment_config(arm),
        # Pass stream chunks through one by one instead of batching them every 50 ms.
        experimental_configs={"stream_batching_interval_ms": 0},
        log_engine_metrics=True,
        callback_config={"callback_class": SkipNodeInitWithoutBucket},
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (`import_path` of an arm in the Serve config): plain args
    `{model, arm, expose_http?}` as `serve_config.arm_application` writes them."""
    arm = ArmEngineConfig.model_validate(args[ARM_ARG])
    model = ModelConfig.model_validate(args[MODEL_ARG])
    # The router's config refuses it already; a Serve config written by hand is checked too.
    if problem := unpinned_code(model, arm):
        raise ValueError(problem)
    return build_llm_deployment(
        build_llm_config(arm, model),
        override_serve_options={"name": arm_app_name(arm.name)},
        deployment_cls=serve.ingress()(ArmServer),
        # `expose_http`: the replica also serves vLLM's own OpenAI app, to clients too.
        bind_kwargs={"arm": arm.name, "expose_vllm": bool(args.get(EXPOSE_HTTP_ARG, False))},
    )
