"""`engine.native.pdl=auto`: the choice between PDL and plain decode graphs by timing both (fused/launch_choice.py).

The events are fakes on a clock the test advances by each "replay": expected verdicts are worked out by hand from the
step times the test sets."""

from __future__ import annotations

import pytest

from hybridrl.engines.config import NativeOptions
from hybridrl.engines.native.launch_choice import PdlChoice
from hybridrl.errors import ConfigError


class Clock:
    """Device time in ms; events stamp it when recorded and complete once `done` is set."""

    def __init__(self) -> None:
        self.now = 0.0
        self.done = True

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.t = clock, None

    def record(self) -> None:
        self.t = self.clock.now

    def query(self) -> bool:
        return self.t is not None and self.clock.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.t - self.t


def run_steps(choice: PdlChoice, clock: Clock, n: int, step_ms) -> list[bool]:
    """`n` steps as the runner takes them: the kind, the timed replay (`step_ms(i, kind)` ms), the poll."""
    kinds = []
    for i in range(n):
        kind = choice.next_kind()
        events = choice.start_timing(kind)
        clock.now += step_ms(i, kind)
        choice.stop_timing(events)
        choice.poll()
        kinds.append(kind)
    return kinds


def test_steps_alternate_in_pairs_whose_order_swaps_then_pdl_waits_for_the_verdict():
    clock = Clock()
    clock.done = False  # the device has not finished the timed steps
    choice = PdlChoice(clock.event, pairs=3)
    kinds = run_steps(choice, clock, 10, lambda i, k: 1.0)
    # pairs: (on, off) (off, on) (on, off) (off, on); the first pair is not timed; then PDL until the verdict
    assert kinds == [True, False, False, True, True, False, False, True, True, True]
    assert choice.deciding and choice.verdict is None and choice.poll() is None
    clock.done = True
    assert choice.poll() is not None and not choice.deciding


def test_a_round_may_start_with_the_plain_kind():
    clock = Clock()
    choice = PdlChoice(clock.event, pairs=2, first=False)
    assert run_steps(choice, clock, 6, lambda i, on: 2.7 if on else 2.8) == [False, True, True, False, False, True]
    assert choice.verdict.pdl and choice.verdict.on_ms == pytest.approx(2.7)


def test_the_first_pair_is_not_timed():
    clock = Clock()
    choice = PdlChoice(clock.event, pairs=2)
    timed = []
    for _ in range(6):
        kind = choice.next_kind()
        timed.append(choice.start_timing(kind) is not None)
        choice.stop_timing(None)
    assert timed == [False, False, True, True, True, True]


def test_plain_graphs_faster_by_more_than_the_margin_turn_pdl_off():
    clock = Clock()
    choice = PdlChoice(clock.event, pairs=4, margin=0.0025)
    # PDL steps 2.80 ms, plain 2.77 ms (PDL 1.08% slower, as in a process that lost the overlap)
    run_steps(choice, clock, 10, lambda i, on: 2.80 if on else 2.77)
    v = choice.verdict
    assert v is not None and not v.pdl and choice.choices == 1
    assert v.on_ms == pytest.approx(2.80) and v.off_ms == pytest.approx(2.77)
    assert v.gain == pytest.approx((2.77 - 2.80) / 2.77)
    assert run_steps(choice, clock, 3, lambda i, on: 1.0) == [False, False, False]


def test_pdl_stays_on_when_faster_or_within_the_margin():
    clock = Clock()
    faster = PdlChoice(clock.event, pairs=4)
    run_steps(faster, clock, 10, lambda i, on: 2.70 if on else 2.77)
    assert faster.verdict.pdl and faster.verdict.gain == pytest.approx(0.07 / 2.77)
    tie = PdlChoice(clock.event, pairs=4, margin=0.0025)
    # plain 0.1% faster: 2.7700 against 2.7728, inside the 0.25% margin
    run_steps(tie, clock, 10, lambda i, on: 2.7728 if on else 2.77)
    assert tie.verdict.pdl


def test_a_rising_step_time_falls_on_both_kinds():
    """Each step 0.01 ms longer than the one before (more keys), PDL 0.02 ms cheaper: pairs with PDL first see it
    0.03 ms cheaper, pairs with PDL second 0.01 ms; their median over 8 pairs (4 of each) is the 0.02 ms."""
    clock = Clock()
    choice = PdlChoice(clock.event, pairs=8, margin=0.0)
    run_steps(choice, clock, 18, lambda i, on: 2.0 + 0.01 * i - (0.02 if on else 0.0))
    assert choice.verdict.pdl
    # timed PDL steps 3, 4, 7, 8, 11, 12, 15, 16 and plain steps 2, 5, 6, 9, 10, 13, 14, 17: medians at i = 9.5 both
    assert choice.verdict.on_ms == pytest.approx(2.075) and choice.verdict.off_ms == pytest.approx(2.095)
    # the same rise with PDL 0.02 ms dearer turns it off
    worse = PdlChoice(clock.event, pairs=8, margin=0.0)
    run_steps(worse, clock, 18, lambda i, on: 2.0 + 0.01 * i + (0.02 if on else 0.0))
    assert not worse.verdict.pdl


def test_restart_chooses_again_and_keeps_the_old_verdict_until_then():
    clock = Clock()
    choice = PdlChoice(clock.event, pairs=2)
    run_steps(choice, clock, 6, lambda i, on: 2.9 if on else 2.8)
    assert not choice.verdict.pdl
    choice.restart()
    assert choice.deciding and not choice.verdict.pdl
    assert run_steps(choice, clock, 6, lambda i, on: 2.7 if on else 2.8) == [True, False, False, True, True, False]
    assert choice.verdict.pdl and choice.choices == 2


def test_pairs_must_be_positive():
    with pytest.raises(ValueError, match="pairs"):
        PdlChoice(Clock().event, pairs=0)


@pytest.mark.parametrize(
    "given, mode",
    [("auto", "auto"), ("on", "on"), ("OFF", "off"), (True, "on"), (False, "off"), ("True", "on"), ("false", "off")],
)
def test_the_option_takes_modes_and_booleans(given, mode):
    assert NativeOptions(pdl=given).pdl == mode


def test_a_bad_mode_names_the_key():
    with pytest.raises(ConfigError, match=r"engine\.native\.pdl must be one of auto, on, off"):
        NativeOptions(pdl="sometimes")
