"""Traffic from a domain the shipped drafters never saw (drafter/domain.py), sent to a running
specserve with the real OpenAI client: what an arm with `capture` keeps for `drafter adapt`.

    python -m specserve.bench.traffic --requests 400 --concurrency 4        # make serve's endpoint

Requests are split by the router's weights unless `--arm` forces one (an admin key, or none on
loopback without keys). Greedy by default (`--temperature`); the answers are not printed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys

from tqdm import tqdm

from specserve import headers
from specserve.drafter.domain import extraction_requests


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="specserve's endpoint")
    parser.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY", "none"))
    parser.add_argument("--model", default=None, help="default: the endpoint's only model")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--arm", help="force this arm (needs an admin key where keys are on)")
    parser.add_argument("--held-out", action="store_true", help="the domain's held-out prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    client = openai.OpenAI(base_url=args.url + "/v1", api_key=args.api_key, max_retries=2)
    model = args.model or client.models.list().data[0].id
    extra = {headers.ARM_OVERRIDE: args.arm} if args.arm else {}
    requests = extraction_requests(args.requests, held_out=args.held_out, seed=args.seed)

    def send(messages) -> str:
        answer = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            extra_headers=extra,
        )
        return answer.choices[0].finish_reason or ""

    failed = 0
    with cf.ThreadPoolExecutor(args.concurrency) as pool:
        futures = [pool.submit(send, r) for r in requests]
        for future in tqdm(cf.as_completed(futures), total=len(futures), desc="traffic"):
            if future.exception() is not None:
                failed += 1
                tqdm.write(f"failed: {future.exception()}")
    print(f"{len(requests) - failed} of {len(requests)} answered", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
