"""A repeated refusal hears what is left of the first one's wait, not the whole wait again."""

from __future__ import annotations

import pytest

from sluice.core.admission import MIN_RETRY_AFTER_S
from sluice.core.retry_after import RetryPromises


def test_a_repeat_hears_what_is_left_of_the_wait() -> None:
    promises = RetryPromises()
    assert promises.retry_after("queue_full", 12.0, now=100.0) == 12.0
    # Nine seconds later the queue says the same (nothing started): three are left.
    assert promises.retry_after("queue_full", 12.0, now=109.0) == pytest.approx(3.0)
    # A queue that now says less wins.
    assert promises.retry_after("queue_full", 1.0, now=110.0) == 1.0


def test_once_the_time_has_passed_the_estimate_is_fresh() -> None:
    promises = RetryPromises()
    promises.retry_after("k", 5.0, now=0.0)
    assert promises.retry_after("k", 8.0, now=6.0) == 8.0
    # Never below the floor, even right at the promised time.
    promises.retry_after("k", 1.0, now=20.0)
    assert promises.retry_after("k", 9.0, now=20.99) == MIN_RETRY_AFTER_S


def test_each_kind_of_refusal_counts_on_its_own() -> None:
    promises = RetryPromises()
    promises.retry_after(("queue_full", "a"), 10.0, now=0.0)
    assert promises.retry_after(("queue_full", "b"), 10.0, now=5.0) == 10.0
    assert promises.retry_after(("queue_full", "a"), 10.0, now=5.0) == pytest.approx(5.0)


def test_memory_stays_bounded() -> None:
    promises = RetryPromises(max_entries=10)
    for i in range(100):
        promises.retry_after(i, 60.0, now=float(i))
    assert len(promises._due) <= 10
    assert promises.retry_after(99, 60.0, now=99.5) == pytest.approx(59.5)
