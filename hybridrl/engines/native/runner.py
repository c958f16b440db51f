"""The decode step over rows [0, B) of a running batch: per-row state on the device, and a CUDA graph per batch
bucket that runs the whole step (forward, sampling, bookkeeping) in one launch. Prompts joining the batch run
packed through `extend`, graphed per token bucket the same way.

Per-row state, in static buffers the graphs read and write in place (the first six are rows of one int64 tensor,
`state`, so rows joining and leaving move them in one copy)::

    tokens  the input token of the next step        pos     its position (= tokens the row has cached)
    steps   the sample index it will draw next      keys    its random-stream key (seeded sampling)
    active  1 for a sequence, 0 for a padding row   table   its block table (padding rows: all scratch block 0)
    shift   its rotary position minus pos (a Qwen2-VL sequence after its images; read only for such a model)

One step: each row's cache slot from (table, pos) → `FusedDecoder.decode` → sample with each row's own key and
step → outputs to `out_tok` / `out_lp`, tokens ← sampled, pos and steps += active (the bookkeeping on either side
of the forward is one kernel each: `kernels/step_state.py`). Rows join with `place` and
leave with `compact` (a few [rows]-sized copies; no KV moves), between steps, so a graph stays valid while
sequences come and go. A graph is captured lazily per (bucket, sampler mode) (`cuda_graphs.GraphCache`), and dropped
by `release` whenever what it points at moves (sleep, a larger cache or block table, new RoPE tables). Unseeded
sampling draws from a torch.Generator, which a graph cannot replay: then the graph covers the forward and the sampler
runs after it.

Mixed steps (what vLLM calls chunked prefill): single requests joining a running batch can have their prompt computed
inside a decode step (`PackedTokens`). Each becomes a row whose input is its last prompt token, at step 0 of its
stream, and its other uncached prompt tokens run as extra rows of the same forward, writing their K/V before the
layer's attention reads them. The step then samples the joiners' first tokens with everyone else's: one pass over the
weights instead of a prefill and a step. Mixed steps are graphed per (batch bucket, bucket of prompt tokens),
captured at a pair's second use.

Rows whose block tables begin with the same blocks (the samples of one GRPO prompt) may read those blocks once per group
in attention (`kernels/shared_prefix.py`) where they share `shared_prefix_tokens` on average: after rows join or leave
the scheduler hands over the live rows' tables where some may share (`share_rows`), and the runner works the groups
out before the next step and copies them into a static buffer the graphs read (a step graphed with grouping is its
own graph).

`extend` runs prompt tokens (an agent's next turn past its cached prefix, or a short new prompt) as rows of the same
layers (`FusedDecoder.extend`), apart from a step. Eagerly that is ~10 launches per layer, ~14 ms of host time at 24
layers on the H200's host, several decode steps' worth; graphed per bucket of token counts it is one launch.
"""

from __future__ import annotations

import torch

from hybridrl.engines.native.cuda_graphs import GraphCache, batch_buckets
from hybridrl.engines.native.kernels.attention import split_count
from hybridrl.engines.native.kernels.shared_prefix import SharedPrefix, pack_prefix, prefix_groups, slot_members
from hybridrl.engines.native.kernels.step_state import advance, cache_slots
from hybridrl.engines.native.kv_cache import SCRATCH_BLOCK, PagedKVCache
from hybridrl.engines.native.model import FusedDecoder, Rope
from hybridrl.engines.native.step_io import HostCopy, PackedTokens, SamplerMode, to_device
from hybridrl.engines.sampling import sample_tokens

_STATE = ("tokens", "steps", "keys", "shift", "pos", "active")  # the rows of `DecodeRunner.state`; pos, active last

# A mixed step is captured at its (rows, prompt tokens) pair's second use: at the end of a multi-turn rollout most pairs
# come once, and a capture costs more than one eager step.
MIXED_CAPTURE_USE = 2


class DecodeRunner:
    """Owns the per-row decode state of up to `rows` sequences and the CUDA graphs captured over it."""

    def __init__(
        self,
        model: FusedDecoder,
        rows: int,
        cuda_graphs: bool,
        extend_tokens: int = 0,
        mixed_tokens: int = 0,
        shared_prefix_tokens: int = 0,
    ) -> None:
        """`extend_tokens`: the most packed prompt tokens one `extend` graph takes (0: extends run eagerly);
        `mixed_tokens`: the most prompt tokens one mixed step takes (`PackedTokens`); `shared_prefix_tokens`: the
        mean tokens per row that rows sharing leading blocks must share for attention to read them once per group
        (`kernels/shared_prefix.py`; 0: never)."""
        self.model, self.rows = model, rows
        self.device = model.device
        self.on_gpu = self.device.type == "cuda"
        self.cuda_graphs = GraphCache(self.device, cuda_graphs and self.on_gpu)
        self.cache: PagedKVCache | None = None
        self._buckets = batch_buckets(rows)
        self._extend_buckets = [b for b in batch_buckets(extend_tokens) if b >= 16] if extend_tokens else []
        self._mixed_buckets = sorted({max(16, b) for b in batch_buckets(mixed_tokens)}) if mixed_tokens else []
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.on_gpu else 1
        self.shared_prefix_tokens = shared_prefix_tokens
        self._members = slot_members(model.q_heads, model.kv_heads) if model.kernels else 0
        self.release()  # no buffers until `bind`

    @property
    def graphs(self) -> dict[tuple, torch.cuda.CUDAGraph]:
        """The captured graphs by key."""
        return self.cuda_graphs.graphs

    @property
    def use_graphs(self) -> bool:
        """Whether steps and extends run as CUDA graphs (off for good after a failed capture)."""
        return self.cuda_graphs.enabled

    @use_graphs.setter
    def use_graphs(self, on: bool) -> None:
        self.cuda_graphs.enabled = on

    # -- buffers ------------------------------------------------------------------------------------------
    def bind(self, cache: PagedKVCache, width: int) -> None:
        """Fresh state buffers over `cache` with block tables `width` blocks wide (drops every graph)."""
        self.release()
        dev, n = self.device, self.rows
        self.cache = cache
        self.state = torch.zeros(len(_STATE), n, dtype=torch.long, device=dev)
        self.tokens, self.steps, self.keys, self.shift, self.pos, self.active = self.state  # in _STATE's order
        self.table = torch.zeros(n, width, dtype=torch.int32, device=dev)
        self.out_tok = torch.zeros(n, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(n, dtype=torch.float32, device=dev)
        vocab_cols = self.model.vocab_rows * self.model.tp.size
        self.logits = torch.empty(n, vocab_cols, dtype=self.model.dtype, device=dev) if self.use_graphs else None
        # Pinned host buffers the steps' outputs come back into, in turn: a step's are read before the next step's
        # launch but one (the scheduler reads one behind), so a ring of three is never overwritten early.
        self._outs = (
            None
            if dev.type != "cuda"
            else [
                [
                    torch.empty(n, dtype=torch.long, pin_memory=True),
                    torch.empty(n, dtype=torch.float32, pin_memory=True),
                ]
                for _ in range(3)
            ]
        )
        self._out_turn = 0
        # Rows sharing leading blocks (`SharedPrefix`, packed as `pack_prefix` lays it out), on the device for the
        # graphs; worked out on the host from the live rows' tables, again only after rows change.
        self._slots = max(1, n // 2)
        self.share = (
            torch.zeros(self._slots * (self._members + 1) + n, dtype=torch.int32, device=dev) if self._members else None
        )

    @property
    def width(self) -> int:
        """Blocks per block table."""
        return self.table.shape[1]

    def grow_table(self, width: int) -> None:
        """Widen the block tables (contents kept); the graphs read the old tensor, so they go."""
        old = self.table
        self.table = torch.zeros(self.rows, width, dtype=torch.int32, device=self.device)
        self.table[:, : old.shape[1]] = old
        self.ext_table = None
        self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget every captured graph (they are captured again on first use; an extend bucket on its second)."""
        self.cuda_graphs.drop()

    def end_rollout(self) -> None:
        """The engine sleeps and keeps its graphs (fixed addresses): keys captured at a later use count their uses
        afresh in the next rollout (`GraphCache.forget_uses`)."""
        self.cuda_graphs.forget_uses()

    def take_capture_stats(self) -> tuple[int, float]:
        """Graphs captured and host seconds spent capturing them since the last call."""
        return self.cuda_graphs.take_stats()

    def release(self) -> None:
        """Drop the graphs, the buffers and the cache reference; `bind` again before the next step."""
        self.drop_graphs()
        self.cache = None
        self.state = self.tokens = self.pos = self.steps = self.keys = self.shift = self.active = self.table = None
        self.out_tok = self.out_lp = self.logits = self._outs = None
        # A graphed extend's inputs (tokens, positions, slots, table rows), the joining sequences' block tables and
        # the tokens whose logits are wanted: made at the first graphed extend after `bind`.
        self.ext_in = self.ext_table = self.ext_last = None
        self.mixed_in = None  # the same four inputs for the prompt tokens of a mixed step
        self.share = None
        self._sharing: tuple[list[list[int]], list[int]] | None = None  # `share_rows`' tables and positions
        self._grouped: bool | None = False  # None: to work out again before the next step

    # -- rows joining and leaving ---------------------------------------------------------------------------
    def place(
        self,
        start: int,
        tokens: torch.Tensor | list[int],
        pos: list[int],
        keys: list[int] | None,
        tables: list[list[int]],
        step: int = 1,
        shifts: list[int] | None = None,
    ) -> None:
        """Rows start.. become sequences with input `tokens` (device, or a host list) at positions `pos`, about to
        draw `step` (1 after a prefill sampled their first token; 0 for rows whose first token the next step samples).
        `shifts`: each row's rotary position minus its cache position (a Qwen2-VL sequence after its images; 0 else).
        One host-to-device copy carries it all."""
        k = len(pos)
        wide = max(len(t) for t in tables)
        host = isinstance(tokens, list)
        # Per row, _STATE's fields (from `steps` where the tokens are on the device already), then its block table.
        packed = to_device(
            [
                ([tokens[i]] if host else [])
                + [step, keys[i] if keys is not None else 0, shifts[i] if shifts is not None else 0, pos[i], 1]
                + tables[i]
                + [0] * (wide - len(tables[i]))
                for i in range(k)
            ],
            torch.long,
            self.device,
        )
        rows, first = slice(start, start + k), 0 if host else 1
        if not host:
            self.tokens[rows] = tokens
        self.state[first:, rows] = packed[:, : len(_STATE) - first].T
        self.table[rows] = 0
        self.table[rows, :wide] = packed[:, len(_STATE) - first :]

    def compact(self, keep: list[int], n_old: int) -> None:
        """Rows `keep` (ascending) move to [0, len(keep)); rows up to n_old become padding again."""
        m = len(keep)
        if keep != list(range(m)):
            idx = to_device(keep, torch.long, self.device)
            self.state[:, :m] = self.state[:, idx]  # the gather copies first: overlapping rows are safe
            self.table[:m] = self.table[idx]
        if n_old > m:
            self.state[_STATE.index("pos") :, m:n_old] = 0  # pos and active
            self.table[m:n_old] = 0

    def share_rows(self, tables: list[list[int]] | None, attended: list[int] | None = None) -> None:
        """After rows joined or left: the live rows' block tables (rows [0, n) in order) and the positions each attends
        at least, for the next steps to group rows that share leading blocks; None where no row shares a block with
        another (nothing to group)."""
        self._sharing = (tables, attended) if tables and self._members else None
        self._grouped = None

    def _shared_prefix(self, b: int, extra: int) -> SharedPrefix | None:
        """The grouping a step of rows [0, b) with `extra` prompt tokens mixed in attends with, or None: grouped
        attention only where it pays (rows share ≥ shared_prefix_tokens on average, the batch fills the SMs unsplit, no
        mixed tokens, the two-kernel attention). Worked out again, and copied to the device, after `share_rows`."""
        bs = self.cache.block_size
        if (
            self._sharing is None
            or not self.shared_prefix_tokens
            or extra
            or not self.model.paged_attention_kernel(bs)
            or split_count(b, self.model.kv_heads, self.width, bs, self.sms) > 1
            or self.model.one_kernel_attention(b, 1)
        ):
            return None
        if self._grouped is None:
            tables, attended = self._sharing
            groups = prefix_groups(tables, attended, bs, self._members)
            shared = sum(len(rows) * n for rows, n in groups) * bs
            self._grouped = shared >= self.shared_prefix_tokens * len(tables)
            if self._grouped:
                self.share.copy_(to_device(pack_prefix(groups, self.rows, self._members), torch.int32, self.device))
        if not self._grouped:
            return None
        cut = self._slots * (self._members + 1)
        return SharedPrefix(self.share[:cut].view(self._slots, -1)[: max(1, b // 2)], self.share[cut:][:b])

    # -- stepping -------------------------------------------------------------------------------------------
    def bucket(self, n: int) -> int:
        """Rows a step runs over when n are live: exact on CPU, the next bucket on GPU."""
        if not self.on_gpu:
            return n
        return next(b for b in self._buckets if b >= n)

    def mixed_bucket(self, n: int) -> int:
        """Extra tokens a step runs over when n prompt tokens are mixed in: 0 for none, else the next bucket on GPU,
        exact on CPU."""
        if not n or not self.on_gpu:
            return n
        return next(b for b in self._mixed_buckets if b >= n)

    def _splits(self, rows: int, keys: int | None) -> int:
        """Attention key splits of a step over `rows` rows (mixed prompt tokens included) whose longest attends `keys`
        keys (None: not known, so no split for a long context)."""
        return split_count(
            rows,
            self.model.kv_heads,
            self.width,
            self.cache.block_size,
            self.sms,
            keys or 0,
            head_dim=self.model.head_dim,
        )

    def _forward(
        self,
        b: int,
        attend: int,
        mixed: torch.Tensor | None = None,
        prefix: SharedPrefix | None = None,
        splits: int = 1,
    ) -> torch.Tensor:
        """Logits [b, padded vocab] of rows [0, b); `mixed` [4, e]: ids, positions, slots, rows of prompt tokens;
        `prefix`: the rows' shared blocks, read once per group; `splits`: the attention's key splits."""
        pos, table = self.pos[:b], self.table[:b]
        bs = self.cache.block_size
        slots = cache_slots(table, pos, bs, self.model.kernels)
        # A multimodal-RoPE model's rows turn at their rotary positions (no mixed steps: its prompts prefill apart).
        rope_pos = pos + self.shift[:b] if self.model.mrope_axes is not None and mixed is None else None
        return self.model.decode(
            self.tokens[:b],
            pos,
            slots,
            table,
            self.cache,
            attend,
            splits,
            mixed=None if mixed is None else tuple(mixed),
            prefix=prefix,
            rope_pos=rope_pos,
        )

    def _padded(self, tokens: PackedTokens, n: int) -> torch.Tensor:
        """[4, n] on the device: the tokens' ids, positions, slots and rows, padded to `n` tokens (position 0 of row
        0, K/V into the scratch slot: written, never read; their logits are never read either)."""
        pad = n - len(tokens.ids)
        return to_device(
            [
                tokens.ids + [0] * pad,
                tokens.pos + [0] * pad,
                tokens.slots + [self.scratch_slot] * pad,
                tokens.rows + [0] * pad,
            ],
            torch.long,
            self.device,
        )

    @property
    def scratch_slot(self) -> int:
        """A cache slot no sequence reads: padding tokens write their K/V there."""
        return SCRATCH_BLOCK * self.cache.block_size

    def _sample_advance(
        self, b: int, logits: torch.Tensor, mode: SamplerMode, generator: torch.Generator | None
    ) -> None:
        tok, lp = sample_tokens(
            logits[:, : self.model.shape.vocab],
            mode.temperature,
            mode.top_k,
            mode.top_p,
            generator,
            keys=self.keys[:b] if mode.seeded else None,
            step=self.steps[:b],
            kernel=mode.kernel,
        )
        advance(
            tok,
            lp,
            self.out_tok[:b],
            self.out_lp[:b],
            self.tokens[:b],
            self.pos[:b],
            self.steps[:b],
            self.active[:b],
            self.model.kernels,
        )

    def launch(
        self,
        n: int,
        mode: SamplerMode,
        generator: torch.Generator | None,
        attend: int,
        mixed: PackedTokens | None = None,
        longest: int | None = None,
    ) -> HostCopy:
        """Queue one decode step of rows [0, n), with `mixed`'s prompt tokens computed inside it, and the copy of their
        sampled tokens and log-probs to the host. `attend` > every live row's position and every mixed token's (the
        torch attention path's gathered width; graphs use the table's); `longest` ≥ the keys any of them attends
        (None: not known), which sets the attention's key splits (one graph per split count)."""
        b = self.bucket(n)
        eb = self.mixed_bucket(len(mixed.ids)) if mixed is not None else 0
        prefix = self._shared_prefix(b, eb)
        splits = 1 if prefix is not None else self._splits(b + eb, longest)
        key = (b, eb, mode if mode.in_graph else None, prefix is not None, splits)
        if self.use_graphs and (not eb or self.cuda_graphs.due(key, MIXED_CAPTURE_USE)):
            if eb:
                if self.mixed_in is None:
                    self.mixed_in = torch.zeros(4, self._mixed_buckets[-1], dtype=torch.long, device=self.device)
                self.mixed_in[:, :eb] = self._padded(mixed, eb)
            graph = self.graphs.get(key) or self._capture(key, b, eb, mode, prefix, splits)
            if graph is not None:
                graph.replay()
                if not mode.in_graph:
                    self._sample_advance(b, self.logits[:b], mode, generator)
                return self._outputs(n)
        if self.use_graphs:
            self.cuda_graphs.eager_steps += 1
        extra = self._padded(mixed, eb) if eb else None  # eagerly at the bucket's shapes too
        self._sample_advance(b, self._forward(b, attend, extra, prefix, splits), mode, generator)
        return self._outputs(n)

    def _outputs(self, n: int) -> HostCopy:
        """The step's tokens and log-probs of rows [0, n) on their way to the host."""
        into = None
        if self._outs is not None:
            into, self._out_turn = self._outs[self._out_turn], (self._out_turn + 1) % len(self._outs)
        return HostCopy([self.out_tok[:n], self.out_lp[:n]], into)

    def _graph_body(self, b: int, eb: int, mode: SamplerMode, prefix: SharedPrefix | None, splits: int) -> None:
        logits = self._forward(
            b, self.width * self.cache.block_size, self.mixed_in[:, :eb] if eb else None, prefix, splits
        )
        if mode.in_graph:
            self._sample_advance(b, logits, mode, None)
        else:
            self.logits[:b].copy_(logits)

    def _capture(
        self, key: tuple, b: int, eb: int, mode: SamplerMode, prefix: SharedPrefix | None, splits: int
    ) -> torch.cuda.CUDAGraph | None:
        """The graph of one decode step (`_graph_body`); None if the capture failed (graphs are off from then on). The
        K/V the warm-up writes are the values the replay writes again."""
        return self.cuda_graphs.capture(
            key,
            lambda: self._graph_body(b, eb, mode, prefix, splits),
            [self.tokens, self.pos, self.steps, self.out_tok, self.out_lp],
        )

    # -- prompts joining ------------------------------------------------------------------------------------
    def extend(
        self,
        tokens: PackedTokens,
        tables: list[list[int]],
        last: list[int],
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """Logits [len(last), padded vocab] of prompt tokens packed as `FusedDecoder.extend` takes them (the tables
        padded to one width). A CUDA graph per token bucket where one serves (GPU, Triton attention, ≤ extend_tokens
        tokens, ≤ rows sequences), captured at a bucket's second use (a GRPO rollout prefills once per wake-up);
        eager with `images` or `rope` (a vision-language prompt's, as `FusedDecoder.extend` takes them)."""
        n, g, dev = len(tokens.ids), len(last), self.device
        bs = self.cache.block_size
        wide = len(tables[0])
        if images is not None or rope is not None:
            return self._extend_eager(tokens, tables, last, images, rope)
        if not (
            self.use_graphs
            and self._extend_buckets
            and n <= self._extend_buckets[-1]
            and g <= self.rows
            and wide <= self.width
            and self.model.paged_attention_kernel(bs)
        ):
            return self._extend_eager(tokens, tables, last)
        nb = next(b for b in self._extend_buckets if b >= n)
        key = ("extend", nb)
        if not self.cuda_graphs.due(key, 2):
            return self._extend_eager(tokens, tables, last)
        gb = min(nb, self.rows)
        if self.ext_in is None:
            self.ext_in = torch.zeros(4, self._extend_buckets[-1], dtype=torch.long, device=dev)
            self.ext_last = torch.zeros(self.rows, dtype=torch.long, device=dev)
        if self.ext_table is None:  # made again when the tables widen
            self.ext_table = torch.zeros(self.rows, self.width, dtype=torch.int32, device=dev)
        self.ext_in[:, :nb] = self._padded(tokens, nb)
        self.ext_table[:g, :wide] = to_device(tables, torch.int32, dev)
        self.ext_last[:gb] = to_device(last + [0] * (gb - g), torch.long, dev)
        graph = self.graphs.get(key) or self.cuda_graphs.capture(key, lambda: self._extend_body(nb, gb), [])
        if graph is None:  # capture failed: graphs are off from now on
            return self.extend(tokens, tables, last)
        graph.replay()
        return self.logits[:g].clone()  # the next graph overwrites the buffer (a later chunk's extend, a decode step)

    def _extend_eager(
        self,
        tokens: PackedTokens,
        tables: list[list[int]],
        last: list[int],
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        dev = self.device
        table = to_device(tables, torch.int32, dev)
        splits = split_count(len(tokens.ids), self.model.kv_heads, table.shape[1], self.cache.block_size, self.sms)
        ids, pos, slots, rows = self._padded(tokens, len(tokens.ids))
        last_t = to_device(last, torch.long, dev)
        max_len = max(tokens.pos) + 1
        return self.model.extend(ids, pos, slots, table, rows, self.cache, last_t, max_len, splits, images, rope)

    def _extend_body(self, nb: int, gb: int) -> None:
        tokens, pos, slots, rows = self.ext_in[:, :nb]
        splits = split_count(nb, self.model.kv_heads, self.width, self.cache.block_size, self.sms)
        self.logits[:gb].copy_(
            self.model.extend(
                tokens,
                pos,
                slots,
                self.ext_table,
                rows,
                self.cache,
                self.ext_last[:gb],
                self.width * self.cache.block_size,
                splits,
            )
        )
