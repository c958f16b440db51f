"""Where each step's metrics go: metrics.jsonl (always), the console, and wandb when selected."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from hybridrl.tracking.config import LoggerConfig
from hybridrl.tracking.plot import plot_run
from hybridrl.tracking.samples import TABLE_KEY, SampleLog, wandb_table

log = logging.getLogger("hybridrl")

# The few numbers the per-step log line shows; every metric goes to metrics.jsonl.
CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("response/length_mean", "len", "{:.1f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.2f}"),
    ("actor/clip_frac", "clip", "{:.3f}"),
    ("mismatch/logp_abs_mean", "mismatch", "{:.1e}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
)


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Tracker:
    """Writes metrics rows; `resume_at(step)` drops rows past a checkpoint so steps never repeat, and a run
    that resumed nothing moves an earlier run's metrics.jsonl aside before its first row."""

    def __init__(
        self, cfg: LoggerConfig, run_dir: str | Path, full_config: dict, job_name: str, sweep_group: str | None
    ) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._continuing = False  # set by resume_at: the rows already in metrics.jsonl belong to this run
        self.wandb = None
        self.sample_log = SampleLog(self.run_dir, cfg.samples_every, cfg.samples_per_step)
        if cfg.name == "wandb":
            self.wandb = self._init_wandb(full_config, job_name, sweep_group)

    def _init_wandb(self, full_config: dict, job_name: str, sweep_group: str | None):
        import wandb

        # Keep every wandb file inside the run dir, not the home folder.
        os.environ.setdefault("WANDB_DIR", str(self.run_dir))
        os.environ.setdefault("WANDB_CACHE_DIR", str(self.run_dir / "wandb-cache"))
        os.environ.setdefault("WANDB_CONFIG_DIR", str(self.run_dir / "wandb-config"))
        # wandb's end-of-run listing is alphabetical and cut at 10 keys (actor/*, batch/*, ... with reward/* behind
        # "+64 ..."); the run's own summary (Controller.summary), led by the reward, follows it on the console.
        try:
            quiet_footer = wandb.Settings(max_end_of_run_summary_metrics=0, max_end_of_run_history_metrics=0)
        except Exception:  # noqa: BLE001 - a wandb before these settings: its listing stays
            quiet_footer = None
        return wandb.init(
            settings=quiet_footer,
            project=self.cfg.project,
            entity=self.cfg.entity,
            group=self.cfg.group or sweep_group,
            name=self.cfg.run_name or job_name,
            tags=list(self.cfg.tags),
            mode=self.cfg.mode or os.environ.get("WANDB_MODE") or "online",
            config=full_config,
            dir=str(self.run_dir),
        )

    def resume_at(self, step: int) -> None:
        """Keep only rows with step <= `step` (a resumed run rewrites what followed its checkpoint)."""
        self._continuing = True
        if not self.metrics_path.exists():
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):
                continue
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.metrics_path)
        self.sample_log.resume_at(step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one row to metrics.jsonl (flushed), log one console line, send to wandb."""
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        if not self._continuing:
            self._set_aside_stale()
            self._continuing = True
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        parts = [f"step {step}"]
        for key, short, fmt in CONSOLE_KEYS:
            if metrics.get(key) is not None:
                parts.append(f"{short} {fmt.format(metrics[key])}")
        phases = [(k[5:], v) for k, v in metrics.items() if k.startswith("time/") and k != "time/step"]
        parts.append("| " + " ".join(f"{p} {v:.2f}s" for p, v in phases))
        if "time/step" in metrics:
            parts.append(f"step {metrics['time/step']:.2f}s")
        log.info(" ".join(parts))
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def _set_aside_stale(self) -> None:
        """A fresh start in a folder that has metrics.jsonl (a run that died before its first checkpoint, or a
        reused hydra.run.dir): move the old file aside, never delete it, so each step appears once."""
        if not self.metrics_path.exists():
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest = self.metrics_path.with_name(f"metrics.jsonl.stale-{stamp}")
        n = 1
        while dest.exists():
            dest, n = self.metrics_path.with_name(f"metrics.jsonl.stale-{stamp}-{n}"), n + 1
        os.replace(self.metrics_path, dest)
        log.warning(
            "metrics.jsonl of an earlier run in this folder moved to %s (this run resumed no checkpoint)", dest.name
        )

    def samples_due(self, step: int) -> bool:
        """Whether `step` writes samples (step 1 and every logger.samples_every steps)."""
        return self.sample_log.due(step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append rollout samples to samples.jsonl (each row gets "step"), and a wandb Table "samples".

        A row: {"prompt", "response", "answer"?, "reward", "reward/<component>"..., "finish_reason"}, as
        `hybridrl.tracking.samples.sample_rows` builds them; at most logger.samples_per_step are kept."""
        written = self.sample_log.write(step, rows)
        if written and self.wandb is not None:
            self.wandb.log({TABLE_KEY: wandb_table(written)}, step=step)

    def plot(self) -> Path | None:
        """plots.png from metrics.jsonl (when enabled and there is something to draw)."""
        if not self.cfg.plot or not self.metrics_path.exists():
            return None
        return plot_run(self.metrics_path, self.run_dir / "plots.png")

    def finish(self) -> None:
        self.plot()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
