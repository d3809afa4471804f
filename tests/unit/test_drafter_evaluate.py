"""How the offline evaluation samples each scored prompt, and which drafters share an engine."""

import json
import shutil

from vllm import SamplingParams

from specserve.drafter.evaluate import sampling_params
from specserve.drafter_checkpoint import interchangeable
from specserve.models import PACKAGED_DRAFTERS_DIR


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


def test_a_candidate_and_its_base_take_turns_in_one_engine_and_other_drafters_do_not(tmp_path):
    """`evaluate` loads a drafter into the engine of the one before it only where the engine
    then runs exactly that drafter: the same tensors and the same config."""
    base = PACKAGED_DRAFTERS_DIR / "eagle3"
    candidate = tmp_path / "candidate"
    shutil.copytree(base, candidate)  # other weights would do: the headers are compared
    assert interchangeable(candidate, base)
    assert not interchangeable(PACKAGED_DRAFTERS_DIR / "eagle3.1", base)  # its norms: tensors
    config = json.loads((candidate / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-5) * 10
    (candidate / "config.json").write_text(json.dumps(config))
    assert not interchangeable(candidate, base)  # the same tensors, another drafter
    assert not interchangeable("org/drafter", base)  # a hub id: no local checkpoint to compare
