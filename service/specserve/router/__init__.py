"""The router: OpenAI ingress, arm selection, streaming proxy, OpenAI errors."""
