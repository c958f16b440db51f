"""Readings of the GPU while a benchmark runs: is a slower phase slower code, or a hotter, lower-clocked device?"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable

import torch


class DeviceMonitor:
    """The GPU's SM clock (MHz), power draw (W) and temperature (°C), read every `interval` seconds on a thread (NVML,
    through torch.cuda) and filed under the phase named last in `tag` (None: not kept). It tells a phase that ran
    slower on a throttled or hotter device from slower code. Where NVML cannot be read (the CPU, no pynvml) it reads
    nothing and `summary` says so. `read`: a stand-in for the reading, for tests."""

    def __init__(
        self, device: torch.device, interval: float = 0.05, read: Callable[[], tuple[float, float, float]] | None = None
    ) -> None:
        self.device, self.interval = device, interval
        self.read = read or self._nvml
        self.tag: str | None = None
        self.samples: dict[str, list[tuple[float, float, float]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.read()
            self.available = True
        except Exception:  # noqa: BLE001 - no NVML here: report that, measure the rest as before
            self.available = False

    def _nvml(self) -> tuple[float, float, float]:
        if self.device.type != "cuda":
            raise RuntimeError("no GPU to read")
        return (
            float(torch.cuda.clock_rate(self.device)),
            torch.cuda.power_draw(self.device) / 1000.0,
            float(torch.cuda.temperature(self.device)),
        )

    def sample(self) -> None:
        """One reading, filed under the current tag."""
        if self.tag is not None:
            self.samples.setdefault(self.tag, []).append(self.read())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> "DeviceMonitor":
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="device-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def summary(self) -> dict:
        """Per tag: the readings' count and the median SM clock, power and temperature."""
        if not self.available:
            return {"available": False}
        return {
            tag: {
                "samples": len(rows),
                "sm_clock_mhz": statistics.median(r[0] for r in rows),
                "power_w": statistics.median(r[1] for r in rows),
                "temperature_c": statistics.median(r[2] for r in rows),
            }
            for tag, rows in self.samples.items()
        }


__all__ = ["DeviceMonitor"]
