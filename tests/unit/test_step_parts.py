"""bench/step_parts: each switched part runs vLLM's function or specserve's wrapper of it, by
the setting in force, and every part is timed and counted."""

import functools

from specserve.bench import step_parts


def test_a_switched_part_runs_vllms_function_or_the_wrapper_by_the_setting():
    ran = []

    def vllm_sample(self, logits, meta):
        ran.append("vllm")

    @functools.wraps(vllm_sample)
    def wrapped_sample(self, logits, meta):
        ran.append("specserve")

    def plain(self, *args):
        ran.append("part")

    parts = dict.fromkeys(step_parts.PARTS, plain) | {"_sample": wrapped_sample}
    runner = type("Runner", (), parts)
    setting = {"now": "vllm"}
    spent, calls = dict.fromkeys(step_parts.PARTS, 0.0), dict.fromkeys(step_parts.PARTS, 0)
    step_parts._instrument(runner, setting, spent, calls)
    runner()._sample(None, None)
    setting["now"] = "specserve"
    runner()._sample(None, None)
    runner().execute_model()
    assert ran == ["vllm", "specserve", "part"]
    assert calls["_sample"] == 2 and calls["execute_model"] == 1 and spent["_sample"] > 0
