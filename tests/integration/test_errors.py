"""Bad input gets a 4xx with an OpenAI error body, and the service keeps serving."""

import concurrent.futures as cf

import pytest

from specserve import headers
from tests.conftest import MODEL

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


# OpenAI's error type for each status a refusal here carries, whoever refused: the router, an
# arm's front or the engine.
OPENAI_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}


def assert_openai_error(response, status, *, param=None, contains=""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == OPENAI_TYPES[status], error
    assert contains.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param


# What the dispatch refuses before any arm is asked is checked case by case on the fake-arm
# harness (tests/unit/test_dispatch_contract.py); here one smoke case each of bad JSON and an
# unknown model, and what the arms' fronts refuse, against the real engines.
@pytest.mark.parametrize(
    ("body", "status", "param", "contains"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        ({"model": MODEL}, 400, "messages", "required"),
        ({"model": "gpt-4", "messages": MSG}, 404, "model", "does not exist"),
        ({"model": MODEL, "messages": "hello"}, 400, "messages", ""),
        ({"model": MODEL, "messages": MSG, "temperature": "hot"}, 400, "temperature", ""),
        ({"model": MODEL, "messages": MSG, "temperature": -1}, 400, "temperature", ""),
        ({"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 10**4}, 400, None, ""),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            400,
            "messages.0.content",
            "",
        ),
        ({"model": MODEL, "messages": MSG, "stream": "maybe"}, 400, "stream", ""),
        # A list, one of `stop`'s two types, over its limit: told the limit.
        ({"model": MODEL, "messages": MSG, "stop": list("abcde")}, 400, "stop", "at most 4"),
        # Found by the schema fuzzer (test_fuzz.py): each was a 500.
        ({"model": MODEL, "messages": 1.5}, 400, "messages", "array"),
        ({"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages.0.role", "role"),
        ({"model": MODEL, "messages": MSG, "structured_outputs": {}}, 400, None, "structured"),
        (
            {"model": MODEL, "messages": MSG, "stream_options": {"include_usage": True}},
            400,
            "stream_options",
            "stream=true",
        ),
    ],
)
def test_bad_requests(live, body, status, param, contains):
    if isinstance(body, bytes):
        response = live.http.post(CHAT, content=body, headers={"content-type": "application/json"})
    else:
        response = live.http.post(CHAT, json=body)
    assert_openai_error(response, status, param=param, contains=contains)


@pytest.mark.parametrize(
    ("prompt_tokens", "status"), [(1023, 200), (1024, 400)], ids=["fits", "one-over"]
)
def test_prompt_at_the_context_boundary(live, prompt_tokens, status):
    """Context 1024: a prompt of 1023 tokens leaves room for exactly one more."""
    body = {"model": MODEL, "prompt": [42] * prompt_tokens, "max_tokens": 1}
    response = live.http.post("/v1/completions", json=body)
    if status == 200:
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (1023, 1)
    else:  # vLLM: no room left for max_tokens
        assert_openai_error(response, 400, contains="max_tokens")


@pytest.mark.parametrize(
    ("body", "param", "contains"),
    [
        ({"model": MODEL}, "prompt", "prompt"),
        ({"model": MODEL, "prompt": "Hi", "logprobs": -6}, "logprobs", "positive"),
        ({"model": MODEL, "prompt": [2**32], "echo": True}, "prompt.0", "out of range"),
        (
            {"model": MODEL, "prompt": "Hi", "response_format": {}},
            "response_format.type",
            "required",
        ),
    ],
)
def test_bad_completion_requests(live, body, param, contains):
    response = live.http.post("/v1/completions", json=body)
    assert_openai_error(response, 400, param=param, contains=contains)


def test_negative_token_ids_are_refused(live):
    body = {"model": MODEL, "prompt": [5, -3, 7], "max_tokens": 2}
    response = live.http.post("/v1/completions", json=body)
    assert_openai_error(response, 400, param="prompt.1", contains="greater than or equal to 0")


def test_internal_headers_cannot_be_forged_and_never_leak(live):
    """The router's own headers between proxy and arm: a client's values are replaced, and the
    arm's usage header never reaches the client."""
    body = {"model": MODEL, "messages": MSG, "max_tokens": 8}
    forged = {headers.REQUEST_TIMEOUT_S: "0.001"}
    for stream in (False, True):
        response = live.http.post(CHAT, json={**body, "stream": stream}, headers=forged)
        assert response.status_code == 200, response.text
        assert "[DONE]" in response.text if stream else response.json()["choices"]
        assert headers.USAGE not in response.headers


def test_the_routers_own_refusals_reach_the_client_in_the_openai_shape(live):
    """One smoke case each (the cases: tests/unit/test_dispatch_contract.py): an unknown arm
    named, a body over the limit, and an arm's own route, which clients reach only through the
    router unless the platform exposes the arms."""
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2}
    unknown = live.http.post(CHAT, json=body, headers={headers.ARM_OVERRIDE: "nope"})
    assert_openai_error(unknown, 400, param=headers.ARM_OVERRIDE, contains="unknown arm")
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300_000}]}
    assert_openai_error(live.http.post(CHAT, json=huge), 413, contains="limit")
    for path in ("/arms/no-spec/v1/chat/completions", "/arms/no-spec/vllm/v1/chat/completions"):
        assert_openai_error(live.http.post(path, json=body), 404, contains="no route")


@pytest.mark.parametrize("arm", ["no-spec", "ngram"])
def test_prompt_over_context_length(live, arm):
    long_prompt = "word " * 3000  # ~3000 tokens, context is 1024
    response = live.http.post(
        CHAT,
        json={"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]},
        headers={headers.ARM_OVERRIDE: arm},
    )
    assert_openai_error(response, 400, contains="maximum context length")
    assert response.headers[headers.ARM] == arm


def test_service_keeps_serving_after_bad_input(live):
    for body in (b"{", b'{"model": 1}'):
        live.http.post(CHAT, content=body)
    ok = live.http.post(CHAT, json={"model": MODEL, "messages": MSG, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def test_seeded_sampling_on_a_speculative_cpu_arm_is_served_and_repeats(live):
    """vLLM's generator rewind killed a speculative CPU engine on the first seeded request
    (`vllm_fixes.skip_generator_rewind`)."""
    arm = "ngram"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "seed": 7}
    body |= {"temperature": 1.0}
    texts = []
    for _ in range(2):
        response = live.http.post("/v1/completions", json=body, headers={headers.ARM_OVERRIDE: arm})
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1]


def test_top_k_without_top_p_on_a_speculative_cpu_arm_is_served(live):
    """vLLM's CPU top-k path failed on a step with no drafted tokens (every prefill) and killed
    the engine for everyone (`vllm_fixes.skip_empty_top_k_top_p`)."""
    body = {"model": MODEL, "messages": MSG, "max_tokens": 8, "temperature": 1.0, "top_k": 5}
    arm = {headers.ARM_OVERRIDE: "ngram"}
    for _ in range(2):
        response = live.http.post(CHAT, json=body, headers=arm)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] > 0


def test_seeded_requests_whose_prefill_is_split_are_served(live):
    """Eight ~900-token seeded prompts at once exceed one step's token budget, so some prefills
    are split; vLLM then rewinds those requests' generators, which CPU generators cannot do
    (it killed the engine for everyone before `vllm_fixes.skip_generator_rewind`)."""
    bodies = [
        {"model": MODEL, "prompt": f"{i} " + "lorem ipsum " * 180, "max_tokens": 4, "seed": i}
        for i in range(8)
    ]
    arm = {headers.ARM_OVERRIDE: "no-spec"}
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(
            pool.map(lambda b: live.http.post("/v1/completions", json=b, headers=arm), bodies)
        )
    assert [a.status_code for a in answers] == [200] * len(bodies), answers[0].text
    again = live.http.post("/v1/completions", json=bodies[0], headers=arm)
    assert again.status_code == 200


def test_sampling_that_speculation_refuses_is_served_by_the_arm_that_does_not_speculate(live):
    """vLLM's speculative decoding refuses logit_bias and min_p: unforced, such requests go to
    `no-spec` and are served; forced onto `ngram`, its engine's refusal reaches the client."""
    for sampling in ({"logit_bias": {"50": 5}}, {"min_p": 0.2}):
        body = {"model": MODEL, "messages": MSG, "max_tokens": 4, **sampling}
        for _ in range(4):
            response = live.http.post(CHAT, json=body)
            assert response.status_code == 200, response.text
            assert response.headers[headers.ARM] == "no-spec"
        forced = live.http.post(CHAT, json=body, headers={headers.ARM_OVERRIDE: "ngram"})
        assert_openai_error(forced, 400, contains="speculative decoding")
