from __future__ import annotations

import pytest

from kvmesh.coordinator.sim.report_clock import ReportClock


def test_on_arrivals_a_report_is_taken_once_an_interval_has_passed_since_the_last():
    clock = ReportClock(500.0, on_clock=False)
    taken = [t for t in (0.0, 100.0, 499.0, 500.0, 999.0, 1000.0) if clock.due_on_arrival(t)]
    assert taken == [0.0, 500.0, 1000.0]
    assert not clock.due_before_event(2000.0)  # events other than arrivals never take one
    clock.check_invariants()


def test_on_the_clock_a_report_is_taken_before_the_first_event_at_or_after_each_tick():
    clock = ReportClock(500.0, on_clock=True)
    taken = [t for t in (0.0, 10.0, 499.9, 500.0, 730.0, 1020.0) if clock.due_before_event(t)]
    assert taken == [0.0, 500.0, 1020.0]
    assert not clock.due_on_arrival(5000.0)  # arrivals do not move the clock
    clock.check_invariants()


def test_on_the_clock_ticks_without_an_event_between_them_give_one_report():
    clock = ReportClock(500.0, on_clock=True)
    assert clock.due_before_event(0.0)
    assert clock.due_before_event(1700.0)  # ticks 500, 1000 and 1500 passed: one report
    assert not clock.due_before_event(1999.0)
    assert clock.due_before_event(2000.0)
    assert clock.num_reports == 3
    clock.check_invariants()


def test_a_report_interval_must_be_positive():
    with pytest.raises(ValueError, match="0 ms"):
        ReportClock(0.0, on_clock=True)
