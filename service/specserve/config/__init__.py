"""The router config: its schema (schema.py), how two configs differ (changes.py), what a config
may set (policy.py) and what vLLM would accept of it (checks.py), the Ray Serve document built
from it (serve_config.py), and where the live one is kept with its history (store.py, as a local
file in local_store.py or a release's ConfigMap in cluster_store.py). Process settings from the
environment are settings.py. It imports nothing from the router, the engines or the wire."""
