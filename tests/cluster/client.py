"""A client run inside another endpoint's network namespace (`ip netns exec ... python -m
tests.cluster.client`): one request through the real OpenAI client, or steady streamed load.

    one URL KEY MODEL stream|plain      -> prints one JSON line: status, text, revision, arm
    load URLS_FILE KEY MODEL STOP OUT   -> streams until STOP exists, a JSON line per request

The load's URLs file names the pods that are endpoints of the API Service now (kube-proxy's
part); it is read before every request, so a pod being deleted gets no new request.
"""

from __future__ import annotations

import json
import sys
import time
from itertools import count
from pathlib import Path

import httpx
import openai

PROMPT = "Name three colours of the rainbow, one per line."
# Below the CPU profile's request timeout (600 s). A request for an arm whose only replica was on
# a deleted pod waits, without a byte, for the pod's drain and the arm's new engine elsewhere:
# 181 s and more on two cores without bf16, where 180 s cut one (the profile has no spare pod:
# docs/kubernetes.md).
REQUEST_TIMEOUT_S = 420


def one(base_url: str, key: str, model: str, stream: bool, max_tokens: int = 24) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT_S)
    messages = [{"role": "user", "content": PROMPT}]
    if not stream:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        body = raw.parse()
        return {
            "status": raw.status_code,
            "text": body.choices[0].message.content,
            "revision": raw.headers.get("x-specserve-config-revision"),
            "arm": raw.headers.get("x-specserve-arm"),
        }
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    ) as response:
        chunks = [c for c in response.parse() if c.choices and c.choices[0].delta.content]
        return {
            "status": response.status_code,
            "text": "".join(c.choices[0].delta.content or "" for c in chunks),
            "chunks": len(chunks),
            "revision": response.headers.get("x-specserve-config-revision"),
            "arm": response.headers.get("x-specserve-arm"),
        }


def load(urls_file: Path, key: str, model: str, stop: Path, out: Path) -> None:
    with out.open("a") as sink:
        for n in count():
            if stop.exists():
                return
            urls = urls_file.read_text().split()
            url = urls[n % len(urls)]
            started = time.time()
            record = {"n": n, "pod_url": url, "started": started}
            try:
                result = one(url, key, model, stream=True, max_tokens=48)
                record |= {
                    "status": result["status"],
                    "chunks": result["chunks"],
                    "arm": result["arm"],
                }
                record["outcome"] = "ok" if result["chunks"] > 0 else "empty"
            except openai.APIStatusError as exc:
                record |= {"status": exc.status_code, "outcome": "refused", "error": str(exc)[:300]}
            except (openai.APIError, httpx.HTTPError) as exc:
                # A stream that began and broke, or a connection that failed.
                record |= {"outcome": "broken", "error": f"{type(exc).__name__}: {exc}"[:300]}
            record["ended"] = time.time()
            sink.write(json.dumps(record) + "\n")
            sink.flush()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "one":
        url, key, model, kind = args
        print(json.dumps(one(url, key, model, stream=kind == "stream")))
    elif mode == "load":
        urls_file, key, model, stop, out = args
        load(Path(urls_file), key, model, Path(stop), Path(out))
    else:
        sys.exit(f"unknown mode {mode}")
