"""What the workers learn of a model: answers' lengths, and several workers' accounts merged."""

from __future__ import annotations

import pytest

from sluice.core.model_info import ModelInfo, merge
from sluice.core.output_lengths import MIN_SAMPLES, OutputLengths


def test_nothing_is_estimated_before_enough_answers() -> None:
    lengths = OutputLengths()
    for _ in range(MIN_SAMPLES - 1):
        lengths.observe(100)
        assert lengths.estimate is None
    lengths.observe(100)
    assert lengths.estimate == 100  # all alike: no spread to add


def test_the_estimate_covers_the_spread_of_answers() -> None:
    lengths = OutputLengths()
    for tokens in [100, 300] * 50:
        lengths.observe(tokens)
    estimate = lengths.estimate
    assert estimate is not None
    # Above the mean (200) by about two standard deviations (100 each), below twice the longest.
    assert 330 <= estimate <= 450


def test_the_estimate_follows_a_change_of_traffic() -> None:
    lengths = OutputLengths()
    for _ in range(50):
        lengths.observe(1000)
    for _ in range(100):  # some tens of answers move it most of the way
        lengths.observe(50)
    estimate = lengths.estimate
    assert estimate is not None and 50 <= estimate < 100


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_nonsense_is_not_learned(bad: float) -> None:
    lengths = OutputLengths()
    lengths.observe(bad)
    assert lengths.samples == 0


def test_accounts_merge_to_the_earliest_creation_the_smallest_window_and_the_most_learned() -> None:
    a = ModelInfo(created=200, context_window=8192, output_tokens=90, output_samples=4)
    b = ModelInfo(created=100, context_window=4096, output_tokens=120, output_samples=40)
    c = ModelInfo()
    assert merge([a, b, c]) == ModelInfo(
        created=100, context_window=4096, output_tokens=120, output_samples=40
    )
    assert merge([]) == ModelInfo()
    assert merge([c]) == ModelInfo()


def test_a_record_from_a_newer_worker_reads() -> None:
    record = {**ModelInfo(created=5, context_window=10).to_dict(), "something_new": 1}
    assert ModelInfo.from_dict(record) == ModelInfo(created=5, context_window=10)
