"""The OpenAI wire, spoken by both the dispatch (router/) and the arms' front (engine/): errors,
request parsing and limits, request validation, the OpenAPI document, and API keys. It imports
nothing from either side."""
