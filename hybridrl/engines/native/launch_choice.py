"""Whether the decode graphs launch with programmatic dependent launch, chosen by timing both in this process.

PDL (`kernels/pdl.py`) lets each Triton kernel's programs start while the kernel ahead finishes. On the H200 it made
the 1.5B GRPO rollout 1.6–2.6% faster in a fresh process, but a process that has run a training step often loses
that gain, and there PDL graphs ran up to 1% slower than plain ones (docs/measurements/README.md, sessions 14–24:
same kernels, same clocks; which processes lose it varies between identical runs, and no setting tried keeps it). A
hybrid engine's process is such a process. So with `engine.native.pdl=auto` (the default) the runner captures each
decode graph both ways, and this class picks one by measurement: after every wake-up (a trainer phase has run since
the last choice) the next decode steps alternate between the two, CUDA events time each replay, and once the events
are done the faster kind serves until the next wake-up.

The steps are timed in pairs, one of each kind, the order swapped every pair, so that the slow growth of a step's
time over a rollout (attention reads one more key a step) falls on both kinds alike; the choice is the median of the
pairs' differences. The first pair after a wake-up is not counted (a graph's first replays after capture or upload
run slower). PDL stays on unless the plain graphs are faster by more than `margin`: a tie is not worth a change.

What it measured (docs/measurements/h200_1204_s24/, h200_1204_s25/): in the 1.5B GRPO rollouts and the 0.5B multi-turn
run the plain graphs won the alternation by 1.0–2.3%, and the rollouts that followed ran as fast as the better fixed
kind, within 0.5%, and 0.8–2.7% faster than an engine with PDL off; at the 0.5B's 64 rows PDL won by 7%. Why plain
graphs beat those of a PDL-off engine: with the verdict forced, the same plain decode graph steps 2.64 ms while the
process-wide switch is on (the launches outside the decode graphs keep PDL) and 2.72 ms with it off, and PDL inside
the decode graph adds nothing on top. Not the capture order, the activations' layout or the prefill's kind; and within
one process that fast state was once lost between two identical runs. So the switch stays on under `auto` and only the
decode graphs' kind is chosen; the choice rests on the measurement, not on an explanation.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridrl.engines.config import PDL_MODES
from hybridrl.engines.native.kernels import pdl as pdl_switch


class TimingEvent(Protocol):
    """The part of `torch.cuda.Event(enable_timing=True)` used here (tests pass fakes)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: TimingEvent) -> float: ...


@dataclass
class PdlVerdict:
    """One choice: the kind kept, and the median step time of each kind over the timed pairs (ms)."""

    pdl: bool
    on_ms: float
    off_ms: float

    @property
    def gain(self) -> float:
        """PDL's saving as a fraction of a plain step (negative: the PDL graphs were slower)."""
        return (self.off_ms - self.on_ms) / self.off_ms if self.off_ms > 0 else 0.0


class PdlChoice:
    """Alternates decode steps between PDL and plain graphs after each `restart`, then keeps the faster kind.

    Per step the runner asks `next_kind()`, launches that kind's graph between `start_timing(kind)`'s events if it
    returns them (recording the first before and `stop_timing` the second after the replay), and calls `poll()`, which
    decides as soon as the timed replays have completed on the device (never waiting for them)."""

    def __init__(self, make_event, pairs: int = 8, margin: float = 0.0025, first: bool = True) -> None:
        """`make_event()`: a new timing event; `pairs`: timed pairs per choice (after one uncounted pair); `margin`:
        how much faster (a fraction) plain steps must be for PDL to be turned off; `first`: the kind of a round's first
        step (True: PDL), so also the kind captured first where neither graph exists yet."""
        if pairs < 1:
            raise ValueError(f"pairs must be >= 1, got {pairs}")
        self.make_event, self.pairs, self.margin, self.first = make_event, pairs, margin, first
        self.verdict: PdlVerdict | None = None
        self.choices = 0  # verdicts reached since this object was made
        self.restart()

    def restart(self) -> None:
        """Choose again from the next step (the process may have changed: call after each wake-up). Until the new
        verdict the steps alternate; the previous verdict is kept for the stats until then."""
        self._steps = 0  # steps handed out in this round
        self._timed: list[tuple[bool, TimingEvent, TimingEvent]] = []
        self._deciding = True

    @property
    def deciding(self) -> bool:
        """Whether steps are still being alternated or timed for the current round."""
        return self._deciding

    def _total_steps(self) -> int:
        return 2 * (self.pairs + 1)

    def next_kind(self) -> bool:
        """The kind of graph the next step launches: True for PDL."""
        if not self._deciding:
            return self.verdict.pdl if self.verdict is not None else True
        if self._steps >= self._total_steps():
            return True  # all timed steps launched; their events are still on the device
        pair, second = divmod(self._steps, 2)
        leading = self.first if pair % 2 == 0 else not self.first  # the kind of this pair's first step
        return leading != bool(second)

    def start_timing(self, kind: bool) -> tuple[TimingEvent, TimingEvent] | None:
        """The events to record around this step's replay (the first now, before it), or None if it is not timed.
        Counts the step: call once per step, after `next_kind`."""
        if not self._deciding or self._steps >= self._total_steps():
            return None
        step = self._steps
        self._steps += 1
        if step < 2:
            return None  # the uncounted first pair
        start, end = self.make_event(), self.make_event()
        start.record()
        self._timed.append((kind, start, end))
        return start, end

    @staticmethod
    def stop_timing(events: tuple[TimingEvent, TimingEvent] | None) -> None:
        """Record the end event of a timed step, right after its replay."""
        if events is not None:
            events[1].record()

    def poll(self) -> PdlVerdict | None:
        """Decide if every timed step has completed on the device; the new verdict, or None if nothing was decided
        by this call."""
        if not self._deciding or len(self._timed) < 2 * self.pairs or not self._timed[-1][2].query():
            return None
        times = [(kind, start.elapsed_time(end)) for kind, start, end in self._timed]
        on = [t for kind, t in times if kind]
        off = [t for kind, t in times if not kind]
        diffs = []  # each pair's PDL step minus its plain step
        for (first_on, first), (_, second) in zip(times[0::2], times[1::2]):
            diffs.append(first - second if first_on else second - first)
        off_ms = statistics.median(off)
        keep = statistics.median(diffs) <= self.margin * off_ms
        self.verdict = PdlVerdict(keep, statistics.median(on), off_ms)
        self.choices += 1
        self._deciding = False
        self._timed = []
        return self.verdict


class PdlLaunches:
    """The decode runner's launch settings: PDL on, off, or chosen (`pdl_mode`), and the PDL trigger. Each change
    drops the graphs it makes stale: a graph keeps the launches it was captured with. Expects `drop_graphs()`,
    `_capture(key, ...)`, `graphs`, `use_graphs` and `device` of the class it is mixed into, and `pdl_choice = None`
    set in its constructor."""

    pdl_choice: PdlChoice | None
    pdl_trial_pairs: int = 8
    """Timed pairs of steps per choice (benchmarks time whole rollouts with more)."""
    pdl_trial_first: bool = True
    """The kind of each choice's first step, so the kind captured first (benchmarks swap it)."""
    use_graphs: bool
    device: torch.device
    graphs: dict

    def drop_graphs(self) -> None:  # pragma: no cover - the runner's
        raise NotImplementedError

    def _capture(self, key: tuple, *shape):  # pragma: no cover - the runner's
        raise NotImplementedError

    def _capture_pair(self, key: tuple, *shape):
        """Capture the graph `key` (its last element the launch kind: None for the switch's) and, under `pdl_auto`,
        its twin of the other kind with it. A choice after a later wake-up may keep the kind the last one dropped:
        with both captured it finds its graphs, so no graph is captured after the first rollout (a fixed-address
        engine keeps them through its sleeps). The graphs share one memory pool, so a twin costs little memory.
        None if a capture failed (the runner then runs eagerly)."""
        graph = self._capture(key, *shape)
        kind = key[-1]
        if graph is not None and kind is not None and (twin := (*key[:-1], not kind)) not in self.graphs:
            self._capture(twin, *shape)
        return graph if self.use_graphs else None

    @property
    def pdl(self) -> bool:
        """Whether the Triton kernels launch with PDL (`kernels/pdl.py`'s process-wide switch; drops the graphs)."""
        return pdl_switch.is_enabled()

    @pdl.setter
    def pdl(self, on: bool) -> None:
        """PDL on or off for every launch from now on (ends `pdl_auto`, and drops the graphs it captured)."""
        self.pdl_auto = False
        if bool(on) != pdl_switch.is_enabled():
            pdl_switch.set_enabled(on)
            self.drop_graphs()

    @property
    def pdl_auto(self) -> bool:
        """Whether the decode graphs' launch kind is chosen by timing (`fused/launch_choice.py`). Only where it can
        matter: graphs on a GPU that runs PDL; elsewhere setting it leaves the switch on and nothing to choose."""
        return self.pdl_choice is not None

    @pdl_auto.setter
    def pdl_auto(self, on: bool) -> None:
        if not on:  # the switch stays as it is; the choice and its graphs go
            if self.pdl_choice is not None:
                self.pdl_choice = None
                self.drop_graphs()
            return
        self.pdl = True  # the switch on: the extend graphs and eager steps launch with it
        if self.use_graphs and pdl_switch.capable(self.device):
            self.pdl_choice = PdlChoice(
                lambda: torch.cuda.Event(enable_timing=True), self.pdl_trial_pairs, first=self.pdl_trial_first
            )

    @property
    def pdl_mode(self) -> str:
        """`engine.native.pdl`'s value as this runner launches: "auto", "on" or "off" (benchmarks' A/B set it)."""
        return "auto" if self.pdl_auto else "on" if self.pdl else "off"

    @pdl_mode.setter
    def pdl_mode(self, mode: str) -> None:
        if mode not in PDL_MODES:
            raise ValueError(f"pdl_mode must be one of {', '.join(PDL_MODES)}, got {mode!r}")
        if mode == "auto":
            if not self.pdl_auto:
                self.pdl_auto = True
        else:
            self.pdl = mode == "on"

    def rechoose(self) -> None:
        """Time both kinds of decode graph again from the next step (after a wake-up: a trainer phase ran)."""
        if self.pdl_choice is not None:
            self.pdl_choice.restart()

    @property
    def pdl_trigger(self) -> str:
        """Where a PDL kernel lets the next launch: "start" or "completion" (`kernels/pdl.py`; drops the graphs)."""
        return "start" if pdl_switch.early_trigger() else "completion"

    @pdl_trigger.setter
    def pdl_trigger(self, where: str) -> None:
        if where not in ("start", "completion"):
            raise ValueError(f"pdl_trigger must be 'start' or 'completion', got {where!r}")
        if (where == "start") != pdl_switch.early_trigger():
            pdl_switch.set_early_trigger(where == "start")
            self.drop_graphs()
