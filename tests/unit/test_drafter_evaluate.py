"""How the offline evaluation samples each scored prompt."""

from vllm import SamplingParams

from specserve.drafter.evaluate import sampling_params


def test_a_prompt_without_captured_sampling_is_scored_greedy():
    params = sampling_params(SamplingParams(temperature=0.6), None, 32, seed=3)
    assert params.temperature == 0.0 and params.max_tokens == 32


def test_captured_sampling_is_used_and_the_engine_defaults_fill_in_what_it_left_out():
    """As a server fills in a request: the model's generation-config defaults where the request
    named no value, the request's own values where it did; seeded, so a score repeats."""
    defaults = SamplingParams(temperature=0.6, top_p=0.9, top_k=20)
    left_out = sampling_params(defaults, {}, 32, seed=3)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.9, 20)
    assert left_out.seed == 3 and left_out.max_tokens == 32
    named = sampling_params(defaults, {"temperature": 1.0, "top_k": 5.0}, 32, seed=4)
    assert (named.temperature, named.top_p, named.top_k, named.seed) == (1.0, 0.9, 5, 4)
