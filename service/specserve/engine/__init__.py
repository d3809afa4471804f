"""Arm engines: one Ray Serve LLM deployment (vLLM engine + draft configuration) per arm."""
