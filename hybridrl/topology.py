"""The process layout of a run, in one object: who is who, which prompts and rows each rank gets, and the groups.

Modelled on torchtitan's `ParallelDims`: the layout is computed here once and every component asks it, so no
other module derives a TP rank, a DP rank or a prompt slice. For 4 workers and `engine.tp_size=2`::

    rank               0      1      2      3
    engine TP group    [0, 1]        [2, 3]           consecutive ranks (vLLM's and SGLang's convention too)
    engine TP rank     0      1      0      1
    engine DP rank     0      0      1      1        one engine replica per TP group
    prompts (16)       0-7    0-7    8-15   8-15     each replica its consecutive share; its TP ranks all see it
    rows (128)         0-31   32-63  64-95  96-127   training: FSDP over every rank, equal consecutive shards

With `trainer.sequence_parallel_size=2` (Ulysses) the trainer's data-parallel ranks are the sequence-parallel (SP)
groups of consecutive ranks, a 2-D mesh dp × sp; every rank of an SP group gets the same rows and computes a slice
of each packed sequence. FSDP still shards over every rank (parameters, gradients and Adam state split 4 ways, not
2: long sequences are what SP is for, and the memory they need is the device's). Reward scoring is not sequence
parallel: it keeps the per-rank shards above::

    rank               0      1      2      3
    SP group           [0, 1]        [2, 3]           consecutive ranks
    SP rank            0      1      0      1        which slice of each packed row
    DP rank            0      0      1      1
    trainer rows (128) 0-63   0-63   64-127 64-127   each DP rank its consecutive share; its SP ranks all see it

Process groups are made on first use and kept: the FSDP mesh over all ranks, the dp × sp mesh with sequence
parallelism, and an engine TP group only for engines that run their own collectives (the native fused engine,
SGLang's CPU leader group); vLLM builds its own. cluster=torchrun's control plane adds a gloo group of two between
rank 0 and each other rank.
Creating a group is collective over the default group: every rank asks for the same groups in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """World size, this rank, the engine's tensor-parallel degree, and everything derived from them."""

    world_size: int
    """Workers in the run (one per device)."""
    engine_tp_size: int = 1
    """Ranks per engine replica (`engine.tp_size`)."""
    rank: int = 0
    """This process's rank (0 on the controller, which plans for every rank)."""
    sequence_parallel_size: int = 1
    """Ranks each packed sequence is split over in the trainer's passes (`trainer.sequence_parallel_size`)."""
    _groups: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"the run needs at least one worker, got world size {self.world_size}")
        if self.engine_tp_size < 1 or self.world_size % self.engine_tp_size:
            raise ConfigError(
                f"engine.tp_size={self.engine_tp_size} must divide the number of workers ({self.world_size})"
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size}")
        sp = self.sequence_parallel_size
        if sp < 1 or self.world_size % sp:
            raise ConfigError(
                f"trainer.sequence_parallel_size={sp} must be >= 1 and divide the number of workers "
                f"({self.world_size}, cluster.workers_per_node x cluster.nnodes)"
            )

    # -- the layout (pure) ------------------------------------------------------------------
    def of_rank(self, rank: int) -> Topology:
        """The same layout seen from `rank`."""
        return Topology(self.world_size, self.engine_tp_size, rank, self.sequence_parallel_size)

    @property
    def engine_dp_size(self) -> int:
        """Engine replicas (TP groups); each generates for its own share of the prompts."""
        return self.world_size // self.engine_tp_size

    @property
    def engine_tp_rank(self) -> int:
        """This rank's place inside its engine TP group."""
        return self.rank % self.engine_tp_size

    @property
    def engine_dp_rank(self) -> int:
        """Which engine replica this rank belongs to."""
        return self.rank // self.engine_tp_size

    @property
    def engine_tp_ranks(self) -> list[int]:
        """Global ranks of this rank's engine TP group, TP rank order."""
        first = self.engine_dp_rank * self.engine_tp_size
        return list(range(first, first + self.engine_tp_size))

    @property
    def is_engine_leader(self) -> bool:
        """Whether this rank is TP rank 0 of its engine (the one that speaks for the replica)."""
        return self.engine_tp_rank == 0

    def engine_leaders(self) -> list[int]:
        """The global rank that speaks for each engine replica, in DP order."""
        return [dp * self.engine_tp_size for dp in range(self.engine_dp_size)]

    def prompt_slices(self, n_prompts: int) -> list[slice]:
        """Each engine replica's consecutive share of `n_prompts` (the last may be short when they do not divide)."""
        share = -(-n_prompts // self.engine_dp_size)
        return [
            slice(min(dp * share, n_prompts), min((dp + 1) * share, n_prompts)) for dp in range(self.engine_dp_size)
        ]

    def prompt_slice(self, n_prompts: int) -> slice:
        """This rank's prompts: its replica's share."""
        return self.prompt_slices(n_prompts)[self.engine_dp_rank]

    @property
    def dp_size(self) -> int:
        """The trainer's data-parallel ranks: SP groups (every rank without sequence parallelism)."""
        return self.world_size // self.sequence_parallel_size

    @property
    def dp_rank(self) -> int:
        """Which SP group (data-parallel rank) this rank belongs to."""
        return self.rank // self.sequence_parallel_size

    @property
    def sp_rank(self) -> int:
        """This rank's place inside its SP group: which slice of each packed sequence it computes."""
        return self.rank % self.sequence_parallel_size

    @property
    def sp_ranks(self) -> list[int]:
        """Global ranks of this rank's SP group, SP rank order."""
        first = self.dp_rank * self.sequence_parallel_size
        return list(range(first, first + self.sequence_parallel_size))

    def dp_leaders(self) -> list[int]:
        """The first rank of each SP group, in DP order: whose trainer results stand for its group's rows."""
        return [dp * self.sequence_parallel_size for dp in range(self.dp_size)]

    def dp_row_slices(self, n_rows: int) -> list[slice]:
        """Each data-parallel rank's equal consecutive share of `n_rows` rows for the trainer's passes (log-probs,
        values, updates); every rank of an SP group gets its group's share."""
        if n_rows % self.dp_size:
            raise ValueError(f"cannot split {n_rows} rows into {self.dp_size} equal shards")
        share = n_rows // self.dp_size
        return [slice(d * share, (d + 1) * share) for d in range(self.dp_size)]

    def row_slices(self, n_rows: int) -> list[slice]:
        """Each rank's equal consecutive share of `n_rows` rows (they must divide evenly): what a pass that is not
        sequence parallel (reward scoring) gives each rank; the trainer's passes use `dp_row_slices`."""
        if n_rows % self.world_size:
            raise ValueError(f"cannot split {n_rows} rows into {self.world_size} equal shards")
        share = n_rows // self.world_size
        return [slice(r * share, (r + 1) * share) for r in range(self.world_size)]

    def padding_rows(self, n_rows: int) -> int:
        """Rows to add so `n_rows` splits evenly over the ranks."""
        return (-n_rows) % self.world_size

    def check_batch(self, prompts_per_step: int, samples_per_prompt: int, mini_batch_size: int = 0) -> None:
        """ConfigError unless a step's prompts and samples divide over the replicas and the ranks."""
        rows = prompts_per_step * samples_per_prompt
        if rows % self.world_size:
            raise ConfigError(
                f"data.train_batch_size * algorithm.group_size = {rows} samples must divide evenly over "
                f"{self.world_size} workers"
            )
        if prompts_per_step % self.engine_dp_size:
            raise ConfigError(
                f"data.train_batch_size={prompts_per_step} must divide over the {self.engine_dp_size} engine groups"
            )
        if mini_batch_size and (rows % mini_batch_size or mini_batch_size % self.dp_size):
            raise ConfigError(
                f"trainer.mini_batch_size={mini_batch_size} must divide the {rows} samples per step "
                f"and be a multiple of the {self._dp_words()}"
            )

    def _dp_words(self) -> str:
        """How an error names the ranks a mini-batch splits over: workers, or SP groups under SP."""
        if self.sequence_parallel_size == 1:
            return f"{self.world_size} workers"
        return f"{self.dp_size} data-parallel ranks (workers / trainer.sequence_parallel_size)"

    # -- process groups (collective; made once) -------------------------------------------------
    def fsdp_mesh(self, device_type: str):
        """The 1-D device mesh FSDP shards over: every rank."""
        key = ("fsdp", device_type)
        if key not in self._groups:
            from torch.distributed.device_mesh import init_device_mesh

            self._groups[key] = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("fsdp",))
        return self._groups[key]

    def sequence_parallel_group(self, device_type: str):
        """This rank's SP process group (None without sequence parallelism), from the 2-D mesh ("dp", "sp") over
        every rank. Collective the first time: every rank calls it at the same point."""
        if self.sequence_parallel_size == 1:
            return None
        key = ("dp_sp", device_type)
        if key not in self._groups:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (self.dp_size, self.sequence_parallel_size)
            self._groups[key] = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "sp"))
        return self._groups[key].get_group("sp")

    def engine_tp_group(self, backend: str | None = None):
        """This rank's engine TP group (None for a TP group of one). Every rank must call this at the same point,
        with the same backend: it creates every replica's group, in order, as `dist.new_group` requires."""
        if self.engine_tp_size == 1:
            return None
        key = ("engine_tp", backend)
        if key not in self._groups:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ConfigError(f"engine.tp_size={self.engine_tp_size} needs torch.distributed initialized first")
            mine = None
            for leader in self.engine_leaders():
                group = dist.new_group(list(range(leader, leader + self.engine_tp_size)), backend=backend)
                if leader == self.engine_tp_ranks[0]:
                    mine = group
            self._groups[key] = mine
        return self._groups[key]

    def control_groups(self, timeout_s: float) -> dict[int, Any]:
        """The control plane of cluster=torchrun: a gloo group of two between rank 0 and each other rank. Rank 0 gets
        {r: group [0, r]} for every other rank, rank r {0: its group}. Every rank creates every group, in order, as
        `dist.new_group` requires, so the groups made later get the same names everywhere."""
        key = ("control", timeout_s)
        if key not in self._groups:
            from datetime import timedelta

            import torch.distributed as dist

            groups = {}
            for r in range(1, self.world_size):
                group = dist.new_group([0, r], backend="gloo", timeout=timedelta(seconds=timeout_s))
                if self.rank in (0, r):
                    groups[r if self.rank == 0 else 0] = group
            self._groups[key] = groups
        return self._groups[key]
