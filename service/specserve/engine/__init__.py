"""Arm engines: one Ray Serve LLM deployment (vLLM engine + draft configuration) per arm."""

from specserve.engine.arm import build_app, build_llm_config

__all__ = ["build_app", "build_llm_config"]
