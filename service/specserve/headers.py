"""HTTP header names, defined once (lower case, as ASGI delivers them)."""

# Request: force this arm (any configured arm, even one with weight 0); unknown -> 400.
ARM_OVERRIDE = "x-specserve-arm"
# Response: the arm that served the request, and the config revision that routed it.
ARM = "x-specserve-arm"
CONFIG_REVISION = "x-specserve-config-revision"
# Request and response: correlates a request with its log lines (Ray Serve's proxy sets it on
# responses, reusing the client's value when there is one).
REQUEST_ID = "x-request-id"
# Request: the client's API key, `Bearer KEY` (wire/auth.py); never passed on to an arm.
AUTHORIZATION = "authorization"
# Response: how to authenticate, on a 401 (`Bearer`).
WWW_AUTHENTICATE = "www-authenticate"
# Response: seconds to wait before retrying a 429/503 (overloaded arm, failed engine, draining).
RETRY_AFTER = "retry-after"
# Response: the methods a route takes, on a 405.
ALLOW = "allow"

# Internal, between the dispatch (the router in each HTTP proxy) and the arms: no client request
# header under this prefix reaches an arm (the dispatch sets its own), and no config may name one.
INTERNAL_PREFIX = "x-specserve-"
# Request: seconds the arm may take for the whole request (the config's `request_timeout_s`).
REQUEST_TIMEOUT_S = "x-specserve-request-timeout-s"
# Request: where a stream cut by a dying replica stands, for the arm to resume it (wire/resume.py).
RESUME_FROM = "x-specserve-resume-from"
# Request: the arm keeps this request's token ids (its capture sample, docs/capture.md); the
# value is the store's bounds as JSON (capture/store.py).
CAPTURE = "x-specserve-capture"
# Request, from a client: `1` keeps the request out of every capture sample (the dispatch reads
# it and does not pass it on).
NO_CAPTURE = "x-specserve-no-capture"
# Response: the token count and speculative-decoding stats of a non-streaming answer, which the
# dispatch records and removes (a stream carries them in its final usage chunk).
USAGE = "x-specserve-usage"

# Request headers that steer Ray Serve's own handling of a request (its proxy reads them): a
# client's are dropped before the request reaches an arm. Ray Serve reads the multiplexed model
# id under any spelling that reads the same with '-' as '_'.
RAY_SERVE_STEERING = ("x-request-disconnect-disabled", "x-request-timeout-seconds")
RAY_SERVE_MULTIPLEXED_MODEL_ID = "serve_multiplexed_model_id"
# A client's `x-request-id` is kept only in this shape (it reaches logs); else a new one is made.
REQUEST_ID_PATTERN = r"[A-Za-z0-9._:-]{1,128}"
