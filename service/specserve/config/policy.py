"""What an arm's `engine` and `env` may set without the operator opting in.

A config chooses among options; it never loads code. Each engine setting on the allow-list below
only tunes what vLLM computes (precision, memory, batching, parallelism, graphs); everything
else, and above all what imports or runs code named in the config (`trust_remote_code`, a worker
class, a plugin), is refused unless the arm names it in `allow_code_loading`, where the operator
takes responsibility for it. Environment variables likewise: vLLM's, OpenMP's, MKL's, NCCL's,
CUDA's and the Hugging Face hub's tuning variables are allowed, but none that names a file,
directory or library to load, nor a secret (docs/config.md, "What a config may load").
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

# vLLM engine arguments an arm may set: each only tunes the computation.
ENGINE_ALLOWED = frozenset(
    {
        # numerics
        "dtype",
        "kv_cache_dtype",
        "quantization",
        "seed",
        # memory and the KV cache
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "block_size",
        "enable_prefix_caching",
        "prefix_caching_hash_algo",
        "cpu_offload_gb",
        "num_gpu_blocks_override",
        # batching and scheduling
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "scheduling_policy",
        "async_scheduling",
        "stream_interval",
        # parallelism (choices among vLLM's own backends)
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enable_expert_parallel",
        "enable_eplb",
        "all2all_backend",
        "moe_backend",
        "disable_custom_all_reduce",
        # graphs and kernels (`compilation_config` only with COMPILATION_ALLOWED keys)
        "enforce_eager",
        "compilation_config",
        "cudagraph_capture_sizes",
        "max_cudagraph_capture_size",
        "optimization_level",
        "performance_mode",
        "attention_backend",
        "disable_sliding_window",
        # outputs and statistics
        "max_logprobs",
        "logprobs_mode",
        "override_generation_config",
        "disable_log_stats",
        "per_request_spec_decode_metrics",
        "enable_logging_iteration_details",
        # which revision of the checkpoint (its weights; its code only with trust_remote_code)
        "revision",
    }
)
# `compilation_config` keys that only choose among vLLM's own modes, graph sizes and passes.
# Left out: `backend` and `inductor_passes` (names of Python functions to import),
# `inductor_compile_config`, `cache_dir` and `debug_dump_path` (files compiled code is loaded
# from or written to).
COMPILATION_ALLOWED = frozenset(
    {
        "mode",
        "cudagraph_mode",
        "cudagraph_capture_sizes",
        "max_cudagraph_capture_size",
        "cudagraph_num_of_warmups",
        "compile_sizes",
        "custom_ops",
        "splitting_ops",
        "use_inductor_graph_partition",
        "pass_config",
    }
)
# Why some settings outside the allow-list are refused (others: "not on the allow-list").
ENGINE_REFUSED = {
    "trust_remote_code": "runs the Python code that ships with the checkpoint",
    "worker_cls": "names a Python class the engine imports and runs",
    "worker_extension_cls": "names a Python class the engine imports and runs",
    "scheduler_cls": "names a Python class the engine imports and runs",
    "logits_processors": "names Python classes the engine imports and runs on every step",
    "model_class_overrides": "names Python classes the engine imports as the model",
    "distributed_executor_backend": "may name an executor class the engine imports",
    "hf_overrides": "rewrites the checkpoint's config (`architectures`, `auto_map`): which "
    "model code runs",
    "load_format": "some formats unpickle weight files or name a loader plugin, which runs code",
    "model_loader_extra_config": "options of the weight loader (deserialisation among them)",
    "io_processor_plugin": "imports a plugin",
    "reasoning_parser_plugin": "imports a Python file",
    "kv_transfer_config": "may name a connector module the engine imports",
    "ec_transfer_config": "may name a connector module the engine imports",
    "logging_config": "a logging configuration may construct any Python class",
    "log_config_file": "a logging configuration may construct any Python class",
    "allowed_local_media_path": "lets requests read the engine host's files",
    "hf_token": "a secret: the chart gives the engines HF_TOKEN from a Secret, while the "
    "config is read by everyone who may read its ConfigMap",
}
COMPILATION_REFUSED = (
    "`backend` and `inductor_passes` name Python functions to import; "
    "`inductor_compile_config`, `cache_dir` and `debug_dump_path` name files compiled code is "
    "loaded from"
)

# Environment variables an arm may set: these prefixes (the thread pools', the collective and
# CUDA runtime's, the hub client's), and these names: of vLLM's own only the tuning and logging
# ones, since others raise the caps the router's limits rely on (VLLM_MAX_N_SEQUENCES,
# VLLM_MAX_COMPLETION_PROMPTS, media sizes and timeouts)...
ENV_ALLOWED_PREFIXES = ("OMP_", "KMP_", "MKL_", "NCCL_", "CUDA_", "HF_HUB_")
ENV_ALLOWED_NAMES = frozenset(
    {
        "TOKENIZERS_PARALLELISM",
        "PYTORCH_CUDA_ALLOC_CONF",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_NUM_OF_RESERVED_CPU",
        "VLLM_USE_FLASHINFER_MOE_FP4",  # the GB200 image's vLLM reads it
        "VLLM_USE_FLASHINFER_SAMPLER",
        "VLLM_USE_DEEP_GEMM",
        "VLLM_LOGGING_LEVEL",
        "VLLM_LOG_STATS_INTERVAL",
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
    }
)
# ...but none that names a file, a directory or a library to load (CUDA_INJECTION64_PATH,
# NCCL_NET_PLUGIN, OMP_TOOL_LIBRARIES, VLLM_NCCL_SO_PATH, NCCL_CONF_FILE, VLLM_CACHE_ROOT...),
# nor a secret.
ENV_REFUSED_SUFFIXES = (
    "_PATH",
    "_PATHS",
    "_DIR",
    "_FOLDER",
    "_ROOT",
    "_FILE",
    "_CACHE",
    "_PLUGIN",
    "_PLUGINS",
    "_LIBRARIES",
    "_TOKEN",
    "_KEY",
    "_SECRET",
    "_PASSWORD",
)
# Refused by name, with the reason (some would otherwise pass as a prefix above).
ENV_REFUSED = {
    "LD_PRELOAD": "loads a shared library into every engine process",
    "LD_AUDIT": "loads a shared library into every engine process",
    "LD_LIBRARY_PATH": "decides which shared libraries the engine processes load",
    "PYTHONPATH": "decides which Python modules the engine processes import",
    "PYTHONHOME": "decides which Python modules the engine processes import",
    "PYTHONUSERBASE": "adds a site-packages directory whose modules and .pth files run",
    "PYTHONSTARTUP": "names a Python file an interpreter runs at start",
    "VLLM_PLUGINS": "chooses the vLLM plugins the engine loads and runs",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "lets the engine unpickle messages, which runs code",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "opens endpoints that load LoRA adapters at run time",
    "VLLM_SERVER_DEV_MODE": "opens vLLM's development endpoints",
    "VLLM_LOGGING_STREAM": "an `ext://` stream imports a Python module",
    "VLLM_USAGE_STATS_SERVER": "sends usage reports to another server",
    "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "copies more variables into the engine workers",
    "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "copies more variables into the engine workers",
    "HF_TOKEN": "a secret: the chart gives the engines HF_TOKEN from a Secret, while the "
    "config is read by everyone who may read its ConfigMap",
}
ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_OPT_IN_ENGINE = "name it in `allow_code_loading.engine` to take responsibility for it"
_OPT_IN_ENV = "name it in `allow_code_loading.env` to take responsibility for it"


def engine_refusal(key: str, value: Any) -> str | None:
    """Why the engine setting `key: value` needs the operator's opt-in; None if it does not."""
    if key in ENGINE_REFUSED:
        return f"`{key}` {ENGINE_REFUSED[key]}; {_OPT_IN_ENGINE}"
    if key not in ENGINE_ALLOWED:
        near = difflib.get_close_matches(key, ENGINE_ALLOWED, n=1)
        hint = f" (did you mean `{near[0]}`?)" if near else ""
        return f"`{key}` is not on the engine allow-list{hint}; {_OPT_IN_ENGINE}"
    if key == "compilation_config" and not isinstance(value, int):
        others = sorted(set(value) - COMPILATION_ALLOWED) if isinstance(value, dict) else [value]
        if others:
            return (
                f"`compilation_config` sets {', '.join(map(str, others))}: "
                f"{COMPILATION_REFUSED}; {_OPT_IN_ENGINE}"
            )
    return None


def env_refusal(name: str) -> str | None:
    """Why the environment variable `name` needs the operator's opt-in; None if it does not."""
    if name in ENV_REFUSED:
        return f"`{name}` {ENV_REFUSED[name]}; {_OPT_IN_ENV}"
    if name.endswith(ENV_REFUSED_SUFFIXES):
        return f"`{name}` names a file, directory, library or secret; {_OPT_IN_ENV}"
    if name in ENV_ALLOWED_NAMES or name.startswith(ENV_ALLOWED_PREFIXES):
        return None
    allowed = ", ".join([*(p + "*" for p in ENV_ALLOWED_PREFIXES), *sorted(ENV_ALLOWED_NAMES)])
    why = " (vLLM's other variables may raise its own caps)" if name.startswith("VLLM_") else ""
    return f"`{name}` is not on the environment allow-list{why} ({allowed}); {_OPT_IN_ENV}"


def non_finite(value: Any, where: str) -> str | None:
    """The first NaN or infinite number in a (nested) setting, by its path."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"`{where}` must be a finite number, not {value}"
    if isinstance(value, dict | list):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            found = non_finite(item, f"{where}.{key}")
            if found:
                return found
    return None


def opt_in_schema() -> dict[str, Any]:
    """A JSON schema rule (for the chart's values.schema.json): an arm with an engine setting or
    an environment variable outside the allow-lists needs `allow_code_loading`. Which names it
    allows is checked by the validators, where the router loads the config and where each arm's
    engine is built."""
    env_allowed = {
        "anyOf": [
            {"pattern": "^(" + "|".join(ENV_ALLOWED_PREFIXES) + ")"},
            {"enum": sorted(ENV_ALLOWED_NAMES)},
        ],
        "not": {
            "anyOf": [
                {"pattern": "(" + "|".join(ENV_REFUSED_SUFFIXES) + ")$"},
                {"enum": sorted(ENV_REFUSED)},
            ]
        },
    }
    outside = {
        "anyOf": [
            {
                "properties": {
                    "engine": {"not": {"propertyNames": {"enum": sorted(ENGINE_ALLOWED)}}}
                },
                "required": ["engine"],
            },
            {
                "properties": {"env": {"not": {"propertyNames": env_allowed}}},
                "required": ["env"],
            },
        ]
    }
    return {"if": outside, "then": {"required": ["allow_code_loading"]}}
