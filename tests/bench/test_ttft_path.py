"""``python -m sluice.bench.ttft_path`` against a simulator: every job's path reaches its four points
(admitted, request written, first chunk in, token read) in order, so each step has a figure per
job (the figures themselves are the benchmark's, not the test's)."""

from __future__ import annotations

from sluice.bench import ttft_path


async def test_each_step_is_measured_for_every_job(sim_url: str) -> None:
    out = await ttft_path.run(3, sim_url)
    assert set(out) == {label for _, _, label in ttft_path.STEPS}
    for label, figures in out.items():
        assert len(figures["calls"]) == 3 and len(figures["us"]) == 3, label
        # Each step ends after it starts: its points were reached, in this order.
        assert all(calls > 0 for calls in figures["calls"]), (label, figures)
        assert all(us > 0 for us in figures["us"]), (label, figures)
