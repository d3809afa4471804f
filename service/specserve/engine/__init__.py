"""Arm engines: one Ray Serve LLM deployment (vLLM engine + draft configuration) per arm."""

from specserve.engine.arm import arm_app_name, arm_route_prefix, build_arm_app, build_llm_config

__all__ = ["arm_app_name", "arm_route_prefix", "build_arm_app", "build_llm_config"]
