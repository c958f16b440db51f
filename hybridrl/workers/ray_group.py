"""`cluster=ray`: the same HybridWorker as Ray actors in one placement group, on one node or many.

Start-up, then one phase command::

    placement group: one bundle per node of workers_per_node × ({"GPU": 1, "CPU": 1} or {"CPU": 1}),
                     on nnodes different nodes (STRICT_SPREAD; one node: STRICT_PACK)
    actors, workers_per_node per bundle, ranks in node order → rank 0 reports its node IP and a free port
    every actor: setup(MASTER_ADDR/PORT, RANK, ...) → HybridWorker joins the torch.distributed group
    run: actor.call.remote(method, ...) on every rank, same order → ray.wait with a deadline
         → results in rank order, or WorkerFailure naming the rank and the phase (then all are stopped)

Ray is optional (`pip install "hybridrl[ray]"`) and imported only here. Each GPU actor sees only
its own GPU (Ray sets CUDA_VISIBLE_DEVICES), so its local device index is 0. Without `cluster.ray_address` the run
starts a private Ray whose files stay in a temporary folder of the run (workers/ray_private.py).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

from hybridrl.errors import HybridRLError
from hybridrl.phases import Phase
from hybridrl.workers.errors import WorkerFailure, raised_message
from hybridrl.workers.failures import STARTUP_S, Answers, Failure, error_summary, phase_deadline_s
from hybridrl.workers.group import WorkerGroup
from hybridrl.workers.process import prepare_worker_process, reward_modules
from hybridrl.workers.ray_private import PrivateRay

log = logging.getLogger("hybridrl")


def import_ray():
    """`ray`, or a HybridRLError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise HybridRLError(f'cluster=ray needs Ray ({e}); install it with: pip install "hybridrl[ray]"') from e
    return ray


class RayWorkerActor:
    """One HybridWorker inside a Ray actor (wrapped with `ray.remote` when the group starts)."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node_info(self) -> tuple[str, int, int, str]:
        """(node IP, a free TCP port on this node, pid, Ray node id)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, os.getpid(), ray.get_runtime_context().get_node_id()

    def setup(self, cfg, rank: int, world_size: int, env: dict[str, str], modules: list[str]) -> None:
        """Build the HybridWorker (joins the process group named by env's MASTER_ADDR/PORT)."""
        os.environ.update(env)
        prepare_worker_process(modules)
        from hybridrl.workers.worker import HybridWorker

        self.worker = HybridWorker(cfg, rank=rank, world_size=world_size, local_rank=0)

    def call(self, phase: str, args: tuple, kwargs: dict) -> Any:
        """One phase command."""
        return getattr(self.worker, Phase(phase).value)(*args, **kwargs)

    def shutdown(self) -> None:
        """Leave the process group; the controller then kills the actor."""
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


class RayWorkerGroup(WorkerGroup):
    """`cluster.nnodes × cluster.workers_per_node` HybridWorkers as Ray actors."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.topology())
        self.ray = import_ray()
        self.timeout_s = cfg.cluster.collective_timeout_s
        self.deadline_s = phase_deadline_s(self.timeout_s)
        self.actors: list[Any] = []
        self.info: list[tuple[str, int, int, str]] = []
        self.pg = None
        self.closed = False
        self.failed = False
        self.private: PrivateRay | None = None
        self._connect(cfg.cluster.ray_address)
        try:
            self._start(cfg)
        except BaseException:
            self.failed = True
            self.shutdown()
            raise

    def _connect(self, address: str | None) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        if address:
            try:
                ray.init(address=address, log_to_driver=True)
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise HybridRLError(
                    f"cluster.ray_address={address!r}: cannot connect to a Ray cluster ({e}); start one with "
                    "`ray start --head --port=6379` and pass its address (or auto on a node of it)"
                ) from e
            return
        self.private = PrivateRay(ray)
        self.private.start(num_cpus=max(self.world_size, os.cpu_count() or 1))

    def _start(self, cfg) -> None:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        total = ray.cluster_resources()
        use_gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and total.get("GPU", 0) >= 1)
        worker = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
        nnodes, per_node = cfg.cluster.nnodes, cfg.cluster.workers_per_node
        need = {k: v * self.world_size for k, v in worker.items()}
        short = {k: v for k, v in need.items() if total.get(k, 0) < v}
        if short:
            raise HybridRLError(
                f"cluster=ray: {self.world_size} workers need {need}, the Ray cluster has "
                f"{ {k: total.get(k, 0) for k in need} } (cluster.nnodes × cluster.workers_per_node too large?)"
            )
        # One bundle per node holding that node's workers: nnodes nodes exactly, workers_per_node on each (a bundle
        # per worker with PACK could crowd a big node and leave the others empty).
        node_bundle = {k: v * per_node for k, v in worker.items()}
        strategy = "STRICT_PACK" if nnodes == 1 else "STRICT_SPREAD"
        self.pg = placement_group([dict(node_bundle) for _ in range(nnodes)], strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=self.deadline_s)
        except ray.exceptions.GetTimeoutError:
            raise HybridRLError(
                f"cluster=ray: could not place {nnodes} node(s) × {node_bundle} ({strategy}) within "
                f"{self.deadline_s:.0f}s; does the Ray cluster have cluster.nnodes={nnodes} nodes with that much "
                "free, or are the resources taken by another job?"
            ) from None
        # Ranks in node order (node b's bundle holds the next workers_per_node ranks), so an engine TP group's ranks
        # share a node.
        actor_cls = ray.remote(RayWorkerActor)
        for node in range(nnodes):
            strat = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=node)
            opts = {"num_cpus": worker["CPU"], "num_gpus": worker.get("GPU", 0), "scheduling_strategy": strat}
            self.actors += [actor_cls.options(max_restarts=0, **opts).remote() for _ in range(per_node)]
        startup = self.deadline_s + STARTUP_S
        self.info = self._gather("init", [a.node_info.remote() for a in self.actors], startup)
        master_addr, master_port = self.info[0][:2]
        where = [f"rank {r} pid {pid} on {ip} (node {node[:8]})" for r, (ip, _, pid, node) in enumerate(self.info)]
        log.info("ray workers: %s", ", ".join(where))
        base = {k: v for k, v in os.environ.items() if k.startswith("HYBRIDRL_")}  # e.g. the model cache
        base.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), WORLD_SIZE=str(self.world_size))
        modules = reward_modules()
        refs = [
            a.setup.remote(cfg, r, self.world_size, dict(base, RANK=str(r), LOCAL_RANK="0"), modules)
            for r, a in enumerate(self.actors)
        ]
        self._gather("init", refs, startup)

    # -- commands ---------------------------------------------------------------------------
    def run(self, phase: Phase, per_rank_args: Sequence[tuple] | None = None, **kwargs: Any) -> list[Any]:
        if self.closed:
            raise WorkerFailure(f"cannot run {str(phase)!r}: the worker group has shut down", phase=str(phase))
        refs = [
            a.call.remote(Phase(phase).value, tuple(per_rank_args[r]) if per_rank_args else (), kwargs)
            for r, a in enumerate(self.actors)
        ]
        try:
            return self._gather(str(phase), refs, self.deadline_s)
        except KeyboardInterrupt:
            self.shutdown()
            raise

    def _gather(self, phase: str, refs: list, deadline_s: float) -> list[Any]:
        """Results in rank order, through the shared failure path."""
        ray = self.ray
        rank_of = {ref: r for r, ref in enumerate(refs)}
        answers = Answers(phase, len(refs), deadline_s, self.timeout_s)
        pending = list(refs)
        while pending and answers.waiting():
            ready, pending = ray.wait(pending, num_returns=1, timeout=answers.remaining())
            for ref in ready:
                r = rank_of[ref]
                try:
                    answers.ok(r, ray.get(ref))
                except ray.exceptions.RayActorError:
                    where = f"pid {self.info[r][2]} on {self.info[r][0]}" if r < len(self.info) else "not started"
                    answers.failed(Failure("died", r, f"worker rank {r} died during {phase!r} (Ray actor {where})"))
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    summary = error_summary(cause) if cause is not None else str(e).strip().splitlines()[-1]
                    answers.failed(Failure("raised", r, raised_message(r, phase, summary), str(e)))

        def stop() -> None:
            self.failed = True
            self.shutdown()

        return answers.results(on_failure=stop)

    # -- teardown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers, kill the actors, remove the placement group; stop Ray if we started it."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        if not self.failed and self.actors:
            try:  # leave the process group cleanly; a stuck worker is killed below anyway
                ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors), timeout=30.0)
            except Exception:  # noqa: BLE001
                pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
        if self.private is not None:
            self.private.stop(keep_logs=self.failed)
