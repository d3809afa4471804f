"""Which bodies the dispatch may replay (router/replays.py): a body whose replay lost its
replica too is refused; one whose replay was answered is replayed again; identical requests cut
together wait for the first replay's fate, so a poisonous body cannot spread over engines."""

from __future__ import annotations

import asyncio

from specserve.router.replays import (
    MAX_REMEMBERED,
    POISON_BUDGET_PER_KEY,
    REMEMBER_S,
    Fate,
    ReplayedBodies,
    replay_identity,
)


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_body_whose_replay_lost_its_replica_is_refused_until_forgotten():
    now = [0.0]
    bodies = ReplayedBodies(clock=lambda: now[0])

    async def main():
        ticket = await bodies.admit(b"poison")
        assert ticket is not None
        ticket.settle(Fate.REPLICA_DIED)
        assert await bodies.admit(b"poison") is None
        assert await bodies.admit(b"other") is not None  # only that body
        now[0] += REMEMBER_S + 1
        assert await bodies.admit(b"poison") is not None

    run(main())


def test_a_body_whose_replay_was_answered_is_replayed_again_until_a_replay_fails():
    bodies = ReplayedBodies()

    async def main():
        first = await bodies.admit(b"hi")
        first.settle(Fate.ANSWERED)
        again = await bodies.admit(b"hi")
        assert again is not None
        again.settle(Fate.REPLICA_DIED)
        assert await bodies.admit(b"hi") is None

    run(main())


def test_an_identical_request_waits_for_the_first_replays_fate():
    async def second_after(fate: Fate) -> bool:
        bodies = ReplayedBodies()
        first = await bodies.admit(b"same")
        waiting = asyncio.ensure_future(bodies.admit(b"same"))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # held while the first replay is under way
        first.settle(fate)
        return await asyncio.wait_for(waiting, 1) is not None

    assert run(second_after(Fate.ANSWERED)) is True
    assert run(second_after(Fate.REPLICA_DIED)) is False
    assert run(second_after(Fate.UNKNOWN)) is True  # nothing learnt: the next one tries


def test_memory_is_bounded_and_a_forgotten_replay_releases_its_waiters():
    bodies = ReplayedBodies()

    async def main():
        first = await bodies.admit(b"0")
        waiting = asyncio.ensure_future(bodies.admit(b"0"))
        await asyncio.sleep(0)
        for i in range(1, MAX_REMEMBERED + 1):
            (await bodies.admit(str(i).encode())).settle(Fate.ANSWERED)
        assert len(bodies._bodies) <= MAX_REMEMBERED
        assert await asyncio.wait_for(waiting, 1) is not None  # asked again, and admitted
        first.settle(Fate.REPLICA_DIED)  # late: the body was forgotten in between

    run(main())


def test_a_body_is_known_without_its_volatile_fields_and_by_its_key():
    body = {"model": "m", "prompt": "poison", "max_tokens": 8}
    same = replay_identity(body, "team-a")
    varied = {"max_tokens": 8, "user": "u2", "seed": 7, "stream": True, **body}
    assert replay_identity(varied, "team-a") == same
    assert replay_identity({**body, "prompt": "poison!"}, "team-a") != same
    assert replay_identity(body, "team-b") != same  # another key, another body

    async def main():
        bodies = ReplayedBodies()
        (await bodies.admit(same, "team-a")).settle(Fate.REPLICA_DIED)
        assert await bodies.admit(replay_identity(varied, "team-a"), "team-a") is None

    run(main())


def test_a_key_whose_body_killed_two_replicas_gets_no_more_replays_for_a_while():
    now = [0.0]
    bodies = ReplayedBodies(clock=lambda: now[0])

    async def main():
        for _ in range(POISON_BUDGET_PER_KEY):
            ticket = await bodies.admit(b"poison-%d" % now[0], "mallory")
            ticket.settle(Fate.REPLICA_DIED)
            now[0] += 1
        # A new body of the same key: not replayed (it would kill a second engine).
        assert await bodies.admit(b"a new poison", "mallory") is None
        assert await bodies.admit(b"a new poison", "alice") is not None  # other keys are not
        now[0] += REMEMBER_S + 1
        assert await bodies.admit(b"later", "mallory") is not None

    run(main())
