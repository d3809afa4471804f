"""The vLLM fixes: the replacement expansion, and that vLLM's own plugin loader applies it."""

from __future__ import annotations

import pytest
import torch

from specserve.engine import vllm_fixes


def test_expand_repeats_each_requests_value_over_its_tokens_keeping_the_dtype():
    temperature = torch.tensor([0.0, 0.7, 1.3], dtype=torch.float32)
    cu_num_tokens = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = vllm_fixes.expand_batch_to_tokens(temperature, cu_num_tokens, 6, 0, 1)
    assert out.dtype == torch.float32  # 0.7 must not be truncated through an integer type
    assert out.tolist() == torch.tensor([1, 1, 0.7, 0.7, 0.7, 1.3]).tolist()

    top_k = torch.tensor([5, 0, 50], dtype=torch.int32)
    out = vllm_fixes.expand_batch_to_tokens(top_k, torch.tensor([1, 1, 4]), 4)
    assert out.dtype == torch.int32 and out.tolist() == [5, 50, 50, 50]  # request 1 drafted none


def test_vllms_plugin_loader_installs_the_fix_on_this_cpu():
    from vllm.plugins import load_general_plugins
    from vllm.v1.sample import rejection_sampler

    load_general_plugins()
    assert rejection_sampler.expand_batch_to_tokens is vllm_fixes.expand_batch_to_tokens


def test_seeded_generators_are_not_rewound_on_cpu():
    from types import SimpleNamespace

    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    with pytest.raises(RuntimeError, match="offset"):  # what vLLM's rewind would call
        torch.Generator().get_offset()
    load_general_plugins()
    assert CPUModelRunner._bookkeeping_sync.skips_generator_rewind

    generators = {0: torch.Generator()}
    runner = SimpleNamespace(input_batch=SimpleNamespace(generators=generators))
    seen = []

    def bookkeeping_sync(self, *args):
        seen.append(dict(self.input_batch.generators))
        return args

    assert vllm_fixes.skip_generator_rewind(bookkeeping_sync)(runner, 1, 2) == (1, 2)
    assert seen == [{}] and runner.input_batch.generators is generators  # restored after


def test_top_k_on_a_step_with_no_drafted_tokens_leaves_the_empty_batch_as_it_is():
    from vllm.plugins import load_general_plugins
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    empty, no_k = torch.empty(0, 10), torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="numel"):  # what killed the engine
        apply_top_k_top_p(empty, no_k, None)
    load_general_plugins()
    fixed = rejection_sampler.apply_top_k_top_p
    assert fixed(empty, no_k, None).shape == (0, 10)

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    masked = fixed(logits.clone(), torch.tensor([2], dtype=torch.int32), None)
    assert torch.isinf(masked).tolist() == [[True, False, True, False]]  # rows still masked


def test_a_step_without_drafts_samples_plainly_and_one_with_drafts_is_verified():
    from types import SimpleNamespace

    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    load_general_plugins()
    assert GPUModelRunner._sample.samples_plainly_without_drafts

    seen = []
    sample = vllm_fixes.plain_sample_without_drafts(lambda self, logits, meta: seen.append(meta))
    no_drafts = SimpleNamespace(max_spec_len=0)  # every request at k = 0 or prefilling
    drafts = SimpleNamespace(max_spec_len=2)
    for meta in (no_drafts, drafts, None):
        sample(object(), "logits", meta)
    assert seen == [None, drafts, None]  # only a step with drafts reaches the rejection sampler


def test_a_step_at_k0_returns_no_drafts_without_the_drafters_inputs_or_pass():
    from types import SimpleNamespace

    calls = []

    def propose_draft_token_ids(self, scheduler_output, *args):
        calls.append(scheduler_output.num_spec_tokens_to_schedule)  # inputs, then the pass
        return "drafts"

    wrapped = vllm_fixes.skip_drafter_at_k0(propose_draft_token_ids)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=3),
        device=torch.device("cpu"),
        _draft_probs=object(),
        _draft_prob_req_ids=["a"],
    )
    out = wrapped(runner, SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert out.shape == (3, 0) and out.dtype == torch.int64 and calls == []  # as vLLM returns
    assert runner._draft_probs is None and runner._draft_prob_req_ids is None
    assert wrapped(runner, SimpleNamespace(num_spec_tokens_to_schedule=2)) == "drafts"
    assert calls == [2]


def test_the_drafter_is_skipped_at_k0_only_where_the_arm_asks(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vllms = GPUModelRunner.propose_draft_token_ids
    vllms = getattr(vllms, "__wrapped__", vllms)
    monkeypatch.setattr(GPUModelRunner, "propose_draft_token_ids", vllms)
    monkeypatch.delenv(vllm_fixes.SKIP_DRAFTER_AT_K0_ENV, raising=False)
    vllm_fixes.register()  # vLLM's plugin entry point, as each engine process runs it
    assert GPUModelRunner.propose_draft_token_ids is vllms
    monkeypatch.setenv(vllm_fixes.SKIP_DRAFTER_AT_K0_ENV, "1")
    vllm_fixes.register()
    vllm_fixes.register()  # wrapped once, however often it runs
    assert GPUModelRunner.propose_draft_token_ids.skips_drafter_at_k0
    assert GPUModelRunner.propose_draft_token_ids.__wrapped__ is vllms


def test_a_step_scheduled_at_k0_is_not_followed_by_a_fetch_of_drafts():
    from types import SimpleNamespace

    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    load_general_plugins()
    assert Scheduler.schedule.records_step_k and EngineCore.post_step.skips_draft_fetch_at_k0

    def schedule(self, *args):
        return SimpleNamespace(num_spec_tokens_to_schedule=self.next_k)

    fetches = []
    record = vllm_fixes.record_step_k(schedule)
    post_step = vllm_fixes.skip_draft_fetch_at_k0(lambda self, executed: fetches.append(executed))
    scheduler = SimpleNamespace()
    engine = SimpleNamespace(scheduler=scheduler)
    post_step(engine, True)  # before any step is scheduled: vLLM's own post_step
    for k in (2, 0, 0, 1):
        scheduler.next_k = k
        assert record(scheduler).num_spec_tokens_to_schedule == k
        post_step(engine, True)
    assert scheduler.step_k == 1 and fetches == [True, True, True]  # none after the k = 0 steps


def test_a_prompt_lookup_drafts_what_followed_the_repeated_suffix_then_the_drafters_tokens():
    import numpy as np

    #                 0   1   2   3   4   5   6   7   8   9
    tokens = np.array([5, 7, 9, 11, 13, 2, 7, 9], dtype=np.int32)  # "7 9" occurred at 1-2
    drafter = [100, 101, 102]
    assert vllm_fixes.lookup_drafts(tokens, drafter, 2, 4096) == [11, 13, 2]
    # A match that must be 3 tokens long: "2 7 9" never occurred before, so the drafter's.
    assert vllm_fixes.lookup_drafts(tokens, drafter, 3, 4096) == drafter
    # A match near the end proposes fewer tokens than k: the drafter's fill the rest.
    near_end = np.array([4, 6, 8, 4, 6], dtype=np.int32)  # "4 6" -> "8 4 6"; then "8" stands
    assert vllm_fixes.lookup_drafts(near_end, drafter, 2, 4096) == [8, 4, 6]
    short = np.array([3, 3], dtype=np.int32)  # "3" -> "3": one token from the lookup
    assert vllm_fixes.lookup_drafts(short, drafter, 1, 4096) == [3, 101, 102]
    # Nothing is drafted past the model's length.
    assert vllm_fixes.lookup_drafts(tokens, drafter, 2, len(tokens) + 1) == [11, 101, 102]


def test_the_lookup_replaces_the_drafts_the_engine_core_takes_request_by_request():
    from types import SimpleNamespace

    import numpy as np
    from vllm.v1.outputs import DraftTokenIds

    rows = np.zeros((3, 16), dtype=np.int32)
    rows[0, :6] = [1, 2, 3, 4, 1, 2]  # "1 2" recurs: the lookup drafts "3 4"
    rows[1, :4] = [5, 6, 7, 8]  # nothing recurs: the drafter's drafts stand
    batch = SimpleNamespace(
        req_id_to_index={"a": 0, "b": 1, "c": 2},
        token_ids_cpu=rows,
        num_tokens_no_spec=np.array([6, 4, 0]),
    )
    runner = SimpleNamespace(input_batch=batch, max_model_len=64)
    taken = DraftTokenIds(["a", "b", "c", "gone"], [[9, 9], [10, 11], [], [12, 13]])
    wrapped = vllm_fixes.prompt_lookup_first(lambda self: taken, 2)
    out = wrapped(runner)
    assert out.req_ids == taken.req_ids
    # "c" drafted nothing (k = 0) and "gone" left the batch: both as they were.
    assert out.draft_token_ids == [[3, 4], [10, 11], [], [12, 13]]
    assert vllm_fixes.prompt_lookup_first(lambda self: None, 2)(runner) is None
