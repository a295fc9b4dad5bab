from __future__ import annotations

import pytest

from sluice.core.health import EngineHealth, HealthState, speed_weights


def test_healthy_until_it_fails() -> None:
    h = EngineHealth()
    assert h.state(0) is HealthState.HEALTHY and h.available(0)
    h.on_dispatch(0)
    h.on_success(0.1)
    assert h.available(0.1)


def test_failure_ejects_then_one_probe_then_healthy() -> None:
    h = EngineHealth(base_ejection_s=1.0)
    h.on_failure(10.0)
    assert h.state(10.5) is HealthState.EJECTED and not h.available(10.5)
    assert h.state(11.0) is HealthState.PROBING and h.available(11.0)
    h.on_dispatch(11.0)
    # Only one probe at a time.
    assert not h.available(11.1)
    h.on_success(11.2)
    assert h.state(11.2) is HealthState.HEALTHY and h.available(11.2)


def test_failed_probe_doubles_the_ejection_up_to_the_cap() -> None:
    h = EngineHealth(base_ejection_s=1.0, max_ejection_s=5.0)
    now = 0.0
    h.on_failure(now)
    lengths = []
    for _ in range(5):
        start = now
        while h.state(now) is HealthState.EJECTED:
            now += 0.25
        lengths.append(now - start)
        h.on_dispatch(now)
        h.on_failure(now)
    assert lengths == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_several_failures_needed_when_configured() -> None:
    h = EngineHealth(failures_to_eject=3)
    h.on_failure(0)
    h.on_failure(0)
    assert h.state(0) is HealthState.HEALTHY
    h.on_success(0)  # a success resets the count
    h.on_failure(0)
    h.on_failure(0)
    assert h.state(0) is HealthState.HEALTHY
    h.on_failure(0)
    assert h.state(0) is HealthState.EJECTED


def test_late_failures_do_not_lengthen_an_ejection() -> None:
    h = EngineHealth(base_ejection_s=1.0)
    h.on_failure(0)
    h.on_failure(0.5)  # a request sent before the ejection fails too
    assert h.state(1.0) is HealthState.PROBING


def test_late_success_while_ejected_does_not_end_it() -> None:
    h = EngineHealth(base_ejection_s=2.0)
    h.on_failure(0)
    h.on_success(0.5)
    assert h.state(1.0) is HealthState.EJECTED


def test_flapping_engine_keeps_doubling_but_a_long_healthy_spell_forgets() -> None:
    h = EngineHealth(base_ejection_s=1.0, max_ejection_s=10.0)
    h.on_failure(0)
    h.on_dispatch(1.0)
    h.on_success(1.0)
    h.on_failure(2.0)  # soon after: twice as long
    assert h.state(3.9) is HealthState.EJECTED and h.state(4.0) is HealthState.PROBING
    h.on_dispatch(4.0)
    h.on_success(4.0)
    h.on_failure(100.0)  # long after: base length again
    assert h.state(100.9) is HealthState.EJECTED and h.state(101.0) is HealthState.PROBING


def test_snapshot_is_jsonable_and_says_the_state() -> None:
    import json

    h = EngineHealth()
    h.on_failure(0)
    snap = h.snapshot(0.25)
    assert json.loads(json.dumps(snap))["state"] == "ejected"
    assert snap["ejected_for_s"] == 0.75 and snap["ejections"] == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        EngineHealth(base_ejection_s=0)
    with pytest.raises(ValueError):
        EngineHealth(base_ejection_s=5, max_ejection_s=1)
    with pytest.raises(ValueError):
        EngineHealth(failures_to_eject=0)


def test_speed_weights_penalise_only_the_much_slower() -> None:
    w = speed_weights({"a": 0.010, "b": 0.012, "c": 0.040, "d": None})
    assert w["a"] == 1.0 and w["b"] == 1.0 and w["d"] == 1.0
    assert w["c"] == pytest.approx(1.5 * 0.012 / 0.040)


def test_two_engines_one_four_times_slower() -> None:
    w = speed_weights({"fast": 0.01, "slow": 0.04})
    assert w == {"fast": 1.0, "slow": pytest.approx(0.375)}


def test_speed_weights_stay_positive_and_handle_nothing_known() -> None:
    assert speed_weights({"a": None, "b": None}) == {"a": 1.0, "b": 1.0}
    assert speed_weights({}) == {}
    w = speed_weights({"a": 0.001, "b": 0.001, "c": 100.0})
    assert 0 < w["c"] < 0.1
