"""Load generation and measurements (router overhead, A/B analysis)."""
