"""plots.png draws validation accuracy beside the validation reward."""

from __future__ import annotations

import json

from hybridrl.tracking.plot import plot_run


def test_validation_accuracy_and_reward_are_drawn(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    labels = []
    real_plot = Axes.plot

    def recording_plot(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording_plot)
    rows = [{"step": s, "reward/mean": s / 10, "response/length_mean": 5.0} for s in range(1, 11)]
    rows[4].update({"val/reward_mean": 0.6, "val/accuracy": 0.25})
    rows[9].update({"val/reward_mean": 0.9, "val/accuracy": 0.75})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_run(path, tmp_path / "plots.png").stat().st_size > 1000
    assert "val/accuracy  last 0.75" in labels and "val/reward_mean  last 0.90" in labels
