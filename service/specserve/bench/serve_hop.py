"""What one Ray Serve hop costs on this machine, apart from anything specserve does.

Two trivial deployments on a fresh local Ray: `target` answers HTTP itself and a streaming handle
call, `ingress` answers HTTP by calling `target` through a handle, as the router calls an arm.
The same request alternates between proxy -> ingress -> target and proxy -> target; the paired
difference is the hop. `--grpc` uses Serve's gRPC transport for the handle call. Ray Serve's
own flags (e.g. `RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`) apply when set in the
environment.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import httpx
import ray
from fastapi import FastAPI, Request
from ray import serve

from specserve.bench.router_overhead import percentile

target_app = FastAPI()
ingress_app = FastAPI()
ANSWER = {"text": "hi"}


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(target_app)
class Target:
    @target_app.post("/")
    async def http(self, request: Request) -> dict:
        await request.body()
        return ANSWER

    async def call(self, body: dict):  # streaming, as an arm's chat/completions
        yield ANSWER


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(ingress_app)
class Ingress:
    def __init__(self, grpc: bool) -> None:
        # `target` is deployed first; one handle for every request, as the router keeps them.
        self.target = serve.get_app_handle("target").options(stream=True, _by_reference=not grpc)

    @ingress_app.post("/")
    async def http(self, request: Request) -> dict:
        stream: Any = self.target.call.remote(await request.json())
        return await stream.__anext__()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=500, help="after 50 warm-up pairs")
    parser.add_argument("--grpc", action="store_true", help="handle calls over gRPC")
    parser.add_argument("--port", type=int, default=8765, help="a free port for the proxy")
    args = parser.parse_args(argv)

    port = args.port
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"port": port})
        serve.run(Target.bind(), name="target", route_prefix="/target")  # type: ignore[attr-defined]
        serve.run(Ingress.bind(args.grpc), name="ingress", route_prefix="/")  # type: ignore[attr-defined]
        base = f"http://127.0.0.1:{port}"
        hop: list[float] = []
        direct: list[float] = []
        with httpx.Client(timeout=30) as client:
            for i in range(50 + args.pairs):
                for url, out in ((f"{base}/", hop), (f"{base}/target/", direct)):
                    start = time.perf_counter()
                    client.post(url, json={"prompt": "x"}).raise_for_status()
                    if i >= 50:
                        out.append((time.perf_counter() - start) * 1000)
    finally:
        serve.shutdown()
        ray.shutdown()
    flags = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
    print(f"handle transport: {'gRPC' if args.grpc else 'actor calls'}; Serve flags: {flags}")
    print(
        f"direct p50 {percentile(direct, 50):.2f} ms, through the extra hop "
        f"p50 {percentile(hop, 50):.2f} ms: added p50 "
        f"{percentile(hop, 50) - percentile(direct, 50):+.2f} ms, paired median "
        f"{statistics.median(h - d for h, d in zip(hop, direct, strict=True)):+.2f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
