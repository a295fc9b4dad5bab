"""``python -m sluice.bench.ttft_path`` against a simulator: every job's path reaches its five points
(admitted, request written, first chunk in, token published, first frame written) in order, so each
step has a figure per job (the figures themselves are the benchmark's, not the test's)."""

from __future__ import annotations

import asyncio

from sluice.bench import ttft_path


async def test_each_step_is_measured_for_every_job(sim_url: str) -> None:
    out = await ttft_path.run(3, sim_url)
    assert set(out) == {label for _, _, label in ttft_path.STEPS}
    for label, figures in out.items():
        assert len(figures["calls"]) == 3 and len(figures["us"]) == 3 and len(figures["turns"]) == 3, label
        # Each step ends after it starts: its points were reached, in this order.
        assert all(calls > 0 for calls in figures["calls"]), (label, figures)
        assert all(us > 0 for us in figures["us"]), (label, figures)
        if label == ttft_path.STEPS[2][2]:
            # The stream's head and first frame go out in the token's publish: no turn between.
            assert all(turns == 0 for turns in figures["turns"]), (label, figures)
        else:
            # The engine client's steps wait a turn at least: a wake-up of another task.
            assert all(turns >= 1 for turns in figures["turns"]), (label, figures)


def test_turns_count_the_loops_turns_between_start_and_stop() -> None:
    async def main() -> int:
        turns = ttft_path.Turns()
        turns.enabled = True
        turns.start()
        for _ in range(5):
            await asyncio.sleep(0)  # one turn each
        turns.stop()
        counted = turns.turns
        for _ in range(3):  # stopped: no more
            await asyncio.sleep(0)
        assert turns.turns == counted
        return counted

    assert asyncio.run(main()) == 5


async def test_the_timeline_cuts_the_first_step_into_parts_that_add_up_to_it(sim_url: str) -> None:
    out = await ttft_path.run(3, sim_url, timeline=True)
    first = ttft_path.STEPS[0][2]
    parts = [label for _, _, label in ttft_path.TIMELINE]
    assert set(parts) <= set(out)
    for key in ("calls", "turns"):
        # The parts' marks are on the same jobs of the same pass: they add up to the whole step.
        summed = [sum(values) for values in zip(*(out[label][key] for label in parts), strict=True)]
        assert summed == out[first][key], key
        assert all(v > 0 for label in parts[:2] for v in out[label]["calls"]), out
