"""The stack-overhead benchmark's config, pairing and summaries, and the stack profile's
attribution of py-spy samples (frames as py-spy writes them, middle frames left out)."""

from pathlib import Path

import pytest
import yaml

from specserve.bench.stack_overhead import (
    ARM,
    SPECSERVE,
    VLLM,
    Stream,
    _stream_summary,
    alternated,
    parse_variant,
    write_config,
)
from specserve.bench.stack_profile import OTHER_PART, part_of, read_parts
from specserve.config.schema import load_config
from specserve.hardware import CPU_BIND_ENV


@pytest.mark.parametrize("kind, arms", [("one-arm", 1), ("default", 4)])
def test_the_config_puts_no_spec_on_the_asked_core_and_stays_valid(tmp_path, kind, arms):
    path = tmp_path / "c.yaml"
    write_config(kind, 1, path)
    config = load_config(path).config  # validates
    assert len(config.arms) == arms
    assert config.arm(ARM).env[CPU_BIND_ENV] == "1"
    assert config.weights[ARM] > 0


def test_pairs_alternate_which_server_goes_first():
    firsts = [first for _, first in alternated(4)]
    assert firsts == [True, False, True, False]


def test_a_variant_is_a_name_and_environment():
    assert parse_variant("inline:A=1,B=x=y") == ("inline", {"A": "1", "B": "x=y"})
    assert parse_variant("bare") == ("bare", {})


def test_stream_summary_pairs_ttft_and_compares_gaps():
    ours = [Stream(0.05, [0.022, 0.022], 3, 0.1), Stream(0.07, [0.024, 0.024], 3, 0.12)]
    theirs = [Stream(0.04, [0.020, 0.020], 3, 0.08), Stream(0.05, [0.020, 0.020], 3, 0.09)]
    found = _stream_summary({SPECSERVE: ours, VLLM: theirs})
    assert found["ttft"]["paired_median"] == pytest.approx(15.0)  # (10 + 20) / 2 ms
    assert found["between_tokens"]["mean_ratio"] == pytest.approx(1.15)
    assert found["tokens"] == {SPECSERVE: 6, VLLM: 6}
    assert found["tokens_per_s"][VLLM] == pytest.approx((3 / 0.08 + 3 / 0.09) / 2)


LOOP = "run (uvloop/__init__.py:82)"
STACKS = {
    "specserve dispatch and arm calls": [
        LOOP,
        "Dispatch.__call__ (specserve/router/dispatch.py:159)",
        "_Exchange._send (specserve/router/dispatch.py:560)",
    ],
    "JSON / pickling": [
        LOOP,
        "ProxyResponseGenerator.__anext__ (ray/serve/_private/proxy_response_generator.py:90)",
        "loads (pickle.py:1)",
    ],
    "HTTP (uvicorn, h11/httptools)": [
        LOOP,
        "HttpToolsProtocol.data_received (uvicorn/protocols/http/httptools_impl.py:130)",
    ],
    "engine step": [
        "EngineCore.step (vllm/v1/engine/core.py:676)",
        "LlamaForCausalLM.forward (vllm/model_executor/models/llama.py:541)",
    ],
}


@pytest.mark.parametrize("part", list(STACKS))
def test_a_sample_goes_to_the_part_of_its_innermost_known_frame(part):
    assert part_of(STACKS[part]) == part


def test_unknown_frames_are_other_and_raw_profiles_add_up(tmp_path: Path):
    assert part_of(["<module> (x.py:1)"]) == OTHER_PART
    raw = tmp_path / "p.txt"
    raw.write_text(
        ";".join(STACKS["engine step"])
        + " 7\n"
        + ";".join(STACKS["specserve dispatch and arm calls"])
        + " 3\n"
        + ";".join(STACKS["engine step"])
        + " 2\n"
    )
    assert read_parts(raw) == {"engine step": 9, "specserve dispatch and arm calls": 3}
    assert read_parts(tmp_path / "missing.txt") == {}


def test_the_written_config_is_yaml_a_user_can_read(tmp_path):
    path = tmp_path / "c.yaml"
    write_config("one-arm", 0, path)
    assert yaml.safe_load(path.read_text())["arms"][0]["name"] == ARM


def test_samples_in_native_code_are_told_apart_from_unknown_python():
    thread = ["Thread._bootstrap (threading.py:1002)", "Thread.run (threading.py:982)"]
    assert part_of(thread) == "event loop thread (native)"
    pool = [*thread, "_worker (concurrent/futures/thread.py:83)", "_WorkItem.run (x:58)"]
    assert part_of(pool) == "thread pool (native)"
    assert part_of([""]) == "native, no Python frame (Ray core worker)"
    # The engine client in the replica is not the engine's step.
    client = [*thread, "AsyncMPClient.get_output_async (vllm/v1/engine/core_client.py:900)"]
    assert part_of(client) != "engine step"


def test_the_rest_of_ray_is_named_by_actor_or_script_and_summed_as_one():
    from specserve.bench.stack_profile import OTHER_RAY, _cpu_of, other_role

    assert other_role("ray::ServeReplica:specserve:router") == "Ray: ServeReplica:specserve:router"
    assert other_role("/venv/bin/python -u /x/ray/_private/log_monitor.py --a") == (
        "Ray: log_monitor.py"
    )
    raylet = "/venv/lib/ray/core/src/ray/raylet/raylet --python_worker_command=x/setup_worker.py"
    assert other_role(raylet) == "Ray: raylet"
    result = {
        "cpu_ms_per_unit": {
            "HTTP proxy": 2.0,
            "engine core": 40.0,
            "engine worker": 50.0,
            "Ray: raylet": 1.0,
            "Ray: log_monitor.py": 0.5,
            "specserve serve (driver)": 0.25,
        }
    }
    assert _cpu_of(result, "HTTP proxy") == 2.0
    assert _cpu_of(result, OTHER_RAY) == 1.75


def test_every_platform_process_gets_its_role_by_its_ray_title():
    from specserve.bench.stack_profile import ROLES

    def role(title: str) -> str | None:
        return next((r for r, marker in ROLES if marker in title), None)

    assert role("ray::ServeReplica:specserve:router") == "router app"
    assert role("ray::ServeReplica:arm-no-spec:arm-no-spec") == "arm replica"
    assert role("ray::ProxyActor.receive_asgi_messages") == "HTTP proxy"
    assert role("VLLM::Worker") == "engine worker"
