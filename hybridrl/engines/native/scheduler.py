"""Continuous batching for the fused engine: requests join a running batch as rows and blocks free up, finished
ones leave; single-turn GRPO rollouts and multi-turn agent loops run through the same loop.

    submit(request, params) → handle          queued; nothing runs yet
    step() → [(handle, Completion), ...]      one turn of the loop below; returns what finished

One `step`::

    1. leave   rows whose sequence finished, or reached max_new_tokens, leave the batch (`DecodeRunner.compact`)
    2. join    waiting requests, in order, while rows and KV blocks last: a run of adjacent requests with the same
               prompt shares one prefill and the prompt's full blocks; each gets its own copy of the last,
               partly filled block; its first token is sampled from the prefill's logits. Single requests (agent
               turns) join inside the next step instead where the engine can (`join_in_step`): a mixed step, what
               vLLM calls chunked prefill, where their uncached prompt tokens run as extra rows of that decode step,
               which samples their first tokens. While a batch runs, requests that would prefill apart may wait up
               to `join_wait` steps so that requests arriving a few steps apart share one prefill: a prefill costs
               more than a decode step, and a row waiting a few steps costs a few tokens. The wait counts from when
               a row is free; they join at once when an eighth of the rows (at least 2) can join. Joins inside a
               step cost no prefill and never wait.
    3. launch  one decode step of every row (a CUDA graph on GPU), its tokens copied to the host asynchronously
    4. read    the outputs queued before that launch: append tokens, detect stops and lengths, free finished
               sequences' blocks

Reading one step behind the launch keeps the device busy while the host does its bookkeeping; the price is that a
row that sampled a stop token runs one more (discarded) step before it leaves. Blocks are reserved at admission for
the whole sequence (prompt + max_new_tokens), so a running sequence never waits for memory and nothing is preempted.
All rows of a batch sample the same way (temperature, top-k/top-p, seeded or not); a request that samples
differently waits until the running batch drains. Each row draws from its own counter stream keyed by
(seed, prompt_index, sample_index) at its own step, so a request's tokens do not depend on what it is batched with.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.native.base import same_prompt
from hybridrl.engines.native.blocks import BlockAllocator, BlockKey, block_keys, image_runs
from hybridrl.engines.native.kv_cache import blocks_for
from hybridrl.engines.native.runner import DecodeRunner
from hybridrl.engines.native.step_io import HostCopy, PackedTokens, SamplerMode, to_device
from hybridrl.engines.sampling import stream_key
from hybridrl.errors import HybridRLError


@dataclass(eq=False)
class SequenceState:
    """One request while the scheduler holds it: waiting, running as a row, or with outputs still to read."""

    handle: int
    request: GenerationRequest
    mode: SamplerMode
    key: int | None
    stops: frozenset[int]
    max_new: int
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    launched: int = 0  # tokens sampled or on their way (the host's count, ahead of `tokens`)
    finish: str | None = None
    keys: list[BlockKey] = field(default_factory=list)  # prefix-table keys of the prompt's full blocks
    prompt_keys: list[BlockKey] | None = None  # the same, kept while it waits (an admission tried again reuses them)
    cohort_len: int = 0  # the longest prompt admitted with it
    shift: int = 0  # rotary position minus cache position of its generated tokens (a prompt with images; its prefill)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    def total_blocks(self, block_size: int) -> int:
        """Blocks the sequence can ever write: positions 0 .. prompt + max_new - 2 (the last token is never fed)."""
        return blocks_for(self.prompt_len + self.max_new - 1, block_size)


@dataclass(eq=False)
class PromptGroup:
    """Adjacent requests with one prompt, admitted together: one prefill, shared full blocks."""

    prompt: list[int]
    shared: list[int]
    seqs: list[SequenceState]
    cached: int = 0
    """Leading prompt tokens whose K/V were found in the prefix table (not prefilled again)."""


class Backend(Protocol):
    """What the scheduler needs of its engine (`FusedEngine` implements it)."""

    runner: DecodeRunner
    block_size: int
    generator: torch.Generator
    image_token_id: int | None
    """The placeholder token of an image (a vision-language model), or None."""

    def kv_allocator(self, need: int, per_seq: int) -> BlockAllocator:
        """The KV cache's allocator. When no block is held, the cache is first made or grown so that `need` blocks
        are free (by demand: room for max_batch_size sequences of `per_seq` blocks), or a clear error raised where
        its size is fixed and too small."""

    def reserve_width(self, blocks: int) -> None:
        """Block tables (and RoPE tables) at least `blocks` wide."""

    def prefill(self, groups: list[PromptGroup], mode: SamplerMode) -> tuple[torch.Tensor, torch.Tensor]:
        """Run each group's prompt once into its first sequence's blocks, copy the partial last block to the others,
        and sample every sequence's first token: (tokens, log-probs) on the device, in group order."""

    def step_prefill_tokens(self, group: PromptGroup) -> int | None:
        """Prompt tokens the group's request would compute inside a mixed step (its uncached prompt but the last
        token, the row's input), or None where it must prefill apart."""

    def join_in_step(self, groups: list[PromptGroup], start: int, mode: SamplerMode) -> PackedTokens:
        """Place the groups' sequences as rows start.. whose first token the next step samples; the prompt tokens
        computed inside that step."""


class Scheduler:
    """The queue, the running batch and the host side of every sequence of one fused engine."""

    def __init__(
        self,
        backend: Backend,
        max_rows: int,
        eos_token_ids: Sequence[int],
        max_model_len: int = 0,
        sampler_kernel: bool = True,
        prefix_cache: bool = True,
        join_wait: int = 0,
        join_step_tokens: int = 0,
    ) -> None:
        self.backend, self.max_rows, self.max_model_len = backend, max_rows, max_model_len
        self.prefix_cache, self.join_wait, self.join_step_tokens = prefix_cache, join_wait, join_step_tokens
        self.eos = frozenset(eos_token_ids)
        self._stop_sets: dict[tuple[int, ...], frozenset[int]] = {}  # `_stops`
        self.sampler_kernel = sampler_kernel
        self.waiting: deque[SequenceState] = deque()
        self.rows: list[SequenceState] = []  # row i of the device state holds rows[i]
        self.pending: list[tuple[list[SequenceState], HostCopy]] = []  # outputs queued, not yet read
        self.mode: SamplerMode | None = None
        self._next_handle = 0
        self._alloc: BlockAllocator | None = None  # the allocator every held block came from
        self.prefilled_tokens = 0  # prompt tokens run through prefill (tests check prompts run once per group)
        self.steps = self.prefills = self.row_steps = 0  # steps taken, admissions (prefill calls), rows × steps
        self.step_joins = 0  # admissions that joined inside a step (no prefill call)
        self.submitted = 0  # requests queued (the rows a rollout could have filled: `take_occupancy`)
        self._occupancy_seen = (0, 0, 0)  # (steps, row_steps, submitted) at the last `take_occupancy`
        self._mixed: PackedTokens | None = None  # prompt tokens computed inside the next launch
        self._mixed_blocks: list[tuple[list[BlockKey], list[int]]] = []  # their full blocks, final once it is queued
        self._room_since: int | None = None  # the step since which a waiting request has had a free row
        # Whether a running row may share leading blocks with another (a group of samples, a prefix found in the table
        # that another row holds): only then does the runner hear of the rows' tables (`DecodeRunner.share_rows`).
        self._may_share = False

    @property
    def has_work(self) -> bool:
        """Whether any submitted request has not been returned by `step` yet."""
        return bool(self.waiting or self.rows or self.pending)

    def submit(self, request: GenerationRequest, params: SamplingParams) -> int:
        """Queue one request (params.n is ignored); returns the handle its completion comes back under."""
        return self.submit_all([request], params)[0]

    def submit_all(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[int]:
        """Queue requests in order, all or none (each is checked first); returns their handles."""
        seqs = [self._sequence(r, params) for r in requests]
        for i, seq in enumerate(seqs):
            seq.handle = self._next_handle + i
        self._next_handle += len(seqs)
        self.waiting.extend(seqs)
        self.submitted += len(seqs)
        return [s.handle for s in seqs]

    def _sequence(self, request: GenerationRequest, params: SamplingParams) -> SequenceState:
        if not request.prompt_ids:
            raise HybridRLError(
                f"native engine: request (prompt {request.prompt_index}, sample "
                f"{request.sample_index}) has an empty prompt"
            )
        max_new = params.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
        if max_new < 1:
            raise HybridRLError(
                f"native engine: request (prompt {request.prompt_index}, sample {request.sample_index}) may generate "
                f"{max_new} tokens; give it at least one"
            )
        need = len(request.prompt_ids) + max_new
        if self.max_model_len and need > self.max_model_len:
            raise HybridRLError(
                f"native engine: a prompt of {len(request.prompt_ids)} tokens + max_new_tokens="
                f"{max_new} needs {need} tokens, more than engine.native.max_model_len="
                f"{self.max_model_len}"
            )
        seeded = params.seed is not None
        mode = SamplerMode(
            float(params.temperature), int(params.top_k), float(params.top_p), seeded, self.sampler_kernel
        )
        key = stream_key(params.seed, request.prompt_index, request.sample_index) if seeded else None
        return SequenceState(-1, request, mode, key, self._stops(params.stop_token_ids), max_new)

    def _stops(self, ids: Sequence[int]) -> frozenset[int]:
        """The EOS ids and a request's stop ids, as one set per distinct list: a rollout's requests share theirs, and
        building it per request costs more than the rest of `submit` where it is long (thousands of ids)."""
        key = tuple(ids)
        stops = self._stop_sets.get(key)
        if stops is None:
            if len(self._stop_sets) >= 64:  # bounded: each distinct list a run uses, not each request
                self._stop_sets.clear()
            stops = self._stop_sets[key] = self.eos | frozenset(key)
        return stops

    def abort(self) -> None:
        """Forget every request (an error, or the engine going to sleep); their handles never complete."""
        held = {id(s): s for s in self.rows} | {id(s): s for seqs, _ in self.pending for s in seqs}
        for s in held.values():
            if s.blocks:
                self._alloc.release(s.blocks)
                s.blocks = []
        if self.rows and self.backend.runner.table is not None:
            self.backend.runner.compact([], len(self.rows))
        self.waiting.clear()
        self.rows.clear()
        self.pending.clear()
        self.mode = self._room_since = self._mixed = None
        self._mixed_blocks = []
        self._may_share = False

    def stop(self) -> list[tuple[int, Completion]]:
        """End every request now, for a partial rollout: outputs already launched are read first (a sequence they
        finish comes back as usual), then every other sequence, running or waiting, comes back with the tokens sampled
        so far and finish_reason 'partial', in handle order. Nothing is left held."""
        done: list[tuple[int, Completion]] = []
        ready, self.pending = self.pending, []
        for seqs, copy in ready:
            self._read(seqs, copy, done)
        left = {s.handle: s for s in [*self.rows, *self.waiting] if s.finish is None}
        for handle in sorted(left):
            s = left[handle]
            done.append((handle, Completion(s.request.prompt_index, s.tokens, s.logprobs, "partial")))
        self.abort()
        return done

    def take_occupancy(self) -> dict[str, float]:
        """Since the last call, where decode steps ran: `perf/engine_rows_mean`, the rows decoded per step on average,
        and `perf/engine_rows_idle`, the share of the rows the rollout could have kept busy (min(max rows, requests
        queued)) that sat idle: the tail in which a batch drains as its rows finish."""
        now = (self.steps, self.row_steps, self.submitted)
        steps, rows, queued = (a - b for a, b in zip(now, self._occupancy_seen))
        self._occupancy_seen = now
        if not steps:
            return {}
        available = min(self.max_rows, queued) if queued else self.max_rows
        return {"perf/engine_rows_mean": rows / steps, "perf/engine_rows_idle": 1.0 - rows / steps / available}

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> list[tuple[int, Completion]]:
        """Advance every running sequence by one token and admit waiting ones; returns those that finished."""
        run = self.backend.runner
        keep = [i for i, s in enumerate(self.rows) if s.finish is None and s.launched < s.max_new]
        changed = len(keep) < len(self.rows)
        if changed:
            run.compact(keep, len(self.rows))
            self.rows = [self.rows[i] for i in keep]
        live = len(self.rows)
        self._admit()
        if changed or len(self.rows) != live:
            self._share_rows(run)
        self.steps += 1
        self.row_steps += len(self.rows)
        launched = []
        if self.rows:
            # The torch attention path's width: positions up to the cohort's longest prompt plus the steps taken
            # (a fixed padding, so float32 CPU runs keep the golden run's numbers bit for bit), within the block
            # tables (a row with a short prompt and many new tokens runs past its cohort's longest sequence).
            width = run.width * self.backend.block_size
            longest = max(s.cohort_len + s.launched for s in self.rows)
            attend = width if run.on_gpu else min(width, longest)
            if self._mixed is not None:
                longest = max(longest, max(self._mixed.pos, default=0) + 1)
            copy = run.launch(len(self.rows), self.mode, self.backend.generator, attend, self._mixed, longest + 1)
            for keys, blocks in self._mixed_blocks:  # only now queued: a failed launch leaves no unwritten entry
                self._alloc.register(keys, blocks)
            self._mixed, self._mixed_blocks = None, []
            launched = [(list(self.rows), copy)]
            for s in self.rows:
                s.launched += 1
        if run.on_gpu:  # read one step behind: the device runs the next step meanwhile
            ready, self.pending = self.pending, launched
        else:  # nothing runs ahead on CPU: read at once, so finished rows never run a wasted step
            ready, self.pending = self.pending + launched, []
        done: list[tuple[int, Completion]] = []
        for seqs, copy in ready:
            self._read(seqs, copy, done)
        if not self.rows and not self.waiting and not self.pending:
            self.mode = None
        return done

    def _share_rows(self, run: DecodeRunner) -> None:
        """Tell the runner the rows' tables where they may share leading blocks, and may share enough of them
        (prompts of at least `shared_prefix_tokens` on average); else that nothing is shared."""
        self._may_share = self._may_share and bool(self.rows)
        shared = run.shared_prefix_tokens
        if self._may_share and shared and sum(s.prompt_len for s in self.rows) >= shared * len(self.rows):
            run.share_rows([s.blocks for s in self.rows], [s.prompt_len for s in self.rows])
        else:
            run.share_rows(None)

    def _admit(self) -> None:
        if not self.waiting or len(self.rows) >= self.max_rows:
            self._room_since = None
            return
        mode = self.waiting[0].mode
        if self.rows and mode != self.mode:
            return  # samples differently: waits until the running batch drains
        if self._room_since is None:
            self._room_since = self.steps
        # The wait counts from when a row was free for the request: with more requests than rows, rows free up one by
        # one as sequences finish, and requests queued long before would otherwise join one prefill per row.
        # Few can join now, more may within a few steps: one prefill for them all (joins inside a step cost no
        # prefill, so they never wait; which ones can is known once their blocks are found, below).
        wait = (
            self.rows
            and min(len(self.waiting), self.max_rows - len(self.rows)) < max(2, self.max_rows // 8)
            and self.steps - self._room_since < self.join_wait
        )
        if not wait:
            self._room_since = None
        groups: list[PromptGroup] = []
        taken: list[SequenceState] = []
        alloc: BlockAllocator | None = None
        while self.waiting and len(self.rows) + len(taken) < self.max_rows:
            seq = self.waiting[0]
            if seq.mode != mode:
                break
            total = seq.total_blocks(self.backend.block_size)
            if alloc is None:  # the pool is made, or grown by demand, only while no block is held
                alloc = self._alloc = self.backend.kv_allocator(0, total)
            if not self._give_blocks(seq, groups, alloc):
                if taken or alloc.held:
                    break  # running sequences free blocks as they finish
                alloc = self._alloc = self.backend.kv_allocator(self._need(seq), total)
                if not self._give_blocks(seq, groups, alloc):
                    break
            self.backend.reserve_width(total)
            taken.append(self.waiting.popleft())
        if not taken:
            return
        in_step = self._joins_in_step(groups)
        if wait and not in_step:
            self._put_back(taken, alloc)
            return
        self._room_since = None
        self.mode = mode
        if 0 < in_step < len(groups):  # the rest wait for the next step, where they may join inside it in turn
            later = [s for g in groups[in_step:] for s in g.seqs]
            self._put_back(later, alloc)
            groups, taken = groups[:in_step], taken[: len(taken) - len(later)]
        longest = max(s.prompt_len for s in taken)
        for s in taken:
            s.cohort_len = longest
        self.prefilled_tokens += sum(len(g.prompt) - g.cached for g in groups)
        # A shared first block with two or more holders: the group's own samples, or another running row.
        self._may_share = self._may_share or any(g.shared and alloc.holders(g.shared[0]) > 1 for g in groups)
        if in_step:
            self._mixed = self.backend.join_in_step(groups, len(self.rows), mode)
            self.step_joins += 1
        else:
            tok, lp = self.backend.prefill(groups, mode)
            self.prefills += 1
        if self.prefix_cache:  # the prompt's full blocks are final once the prefill, or the step, is queued
            for g in groups:
                if in_step:
                    self._mixed_blocks.append((g.seqs[0].keys, g.shared))
                else:
                    alloc.register(g.seqs[0].keys, g.shared)
        if in_step:
            self.rows += taken  # launched 0: the step about to run samples their first tokens
            return
        self.pending.append((taken, HostCopy([tok, lp])))
        for s in taken:
            s.launched = 1
        going = [i for i, s in enumerate(taken) if s.max_new > 1]
        if going:
            idx = to_device(going, torch.long, tok.device) if len(going) < len(taken) else None
            self.backend.runner.place(
                len(self.rows),
                tok if idx is None else tok[idx],
                [taken[i].prompt_len for i in going],
                [taken[i].key for i in going] if mode.seeded else None,
                [taken[i].blocks for i in going],
                shifts=[taken[i].shift for i in going],
            )
            self.rows += [taken[i] for i in going]

    def _put_back(self, seqs: list[SequenceState], alloc: BlockAllocator) -> None:
        """Sequences just taken go back to the head of the queue, in order, their blocks released."""
        for s in seqs:
            alloc.release(s.blocks)
            s.blocks, s.keys = [], []
        self.waiting.extendleft(reversed(seqs))

    def _joins_in_step(self, groups: list[PromptGroup]) -> int:
        """How many leading groups join inside the next step (0: all prefill apart). All of them where their prompt
        tokens fit `join_step_tokens`; else those that fit, while the batch runs and few are left over (they wait a
        step); else none: a burst (a batch starting, a wave of rows freed at once) prefills in one pass."""
        joining, spent = 0, 0
        for g in groups:
            n = self.backend.step_prefill_tokens(g) if self.join_step_tokens else None
            if n is None or spent + n > self.join_step_tokens:
                break
            joining, spent = joining + 1, spent + n
        left = sum(len(g.seqs) for g in groups[joining:])
        if joining < len(groups) and not (self.rows and left < max(2, self.max_rows // 8)):
            return 0
        return joining

    def _need(self, seq: SequenceState) -> int:
        """Blocks `seq` takes when nothing is shared with it."""
        return seq.total_blocks(self.backend.block_size)

    def _give_blocks(self, seq: SequenceState, groups: list[PromptGroup], alloc: BlockAllocator) -> bool:
        """Assign `seq` its block table: the prompt's full blocks shared with the group it joins (the previous
        request had the same prompt) or found in the prefix table, the rest its own. False if they are not free."""
        bs = self.backend.block_size
        full, own = seq.prompt_len // bs, seq.total_blocks(bs) - seq.prompt_len // bs
        if groups and same_prompt(groups[-1].seqs[0].request, seq.request):
            group = groups[-1]
            if own > alloc.free:
                return False
            alloc.share(group.shared)
            seq.keys, seq.blocks = group.seqs[0].keys, group.shared + alloc.allocate(own)
            group.seqs.append(seq)
            return True
        if seq.prompt_keys is None:
            seq.prompt_keys = self._keys(seq, seq.request.prompt_ids, full) if self.prefix_cache else []
        keys = seq.prompt_keys
        # At least the last prompt token is run again: its logits give the first sample.
        found = alloc.match(keys[: (seq.prompt_len - 1) // bs])
        if full - len(found) + own > alloc.free:
            alloc.release(found)
            return False
        shared = found + alloc.allocate(full - len(found))
        seq.keys, seq.blocks = keys, shared + alloc.allocate(own)
        groups.append(PromptGroup(seq.request.prompt_ids, shared, [seq], len(found) * bs))
        return True

    def _keys(self, seq: SequenceState, tokens: list[int], full: int, start: int = 0) -> list[BlockKey]:
        """Prefix-table keys of blocks start..full-1 of `tokens` (the sequence's prompt, then its samples), keyed on
        its images' content where it has images (none for images of unknown content: they are never matched)."""
        images, runs = seq.request.images, ()
        if images is not None:
            if not all(images.digests):
                return []
            runs = image_runs(tokens, self.backend.image_token_id, images.digests)
        parent = seq.keys[start - 1] if start else None
        return block_keys(tokens, self.backend.block_size, full, start=start, parent=parent, images=runs)

    def _finish(self, s: SequenceState) -> None:
        """Enter the sequence's full blocks of final K/V in the prefix table, then drop its references."""
        if self.prefix_cache:
            written = s.prompt_len + len(s.tokens) - 1  # K/V exist for every token but the last
            full = written // self.backend.block_size
            if full > len(s.keys):
                s.keys = s.keys + self._keys(s, s.request.prompt_ids + s.tokens, full, start=len(s.keys))
            self._alloc.register(s.keys[:full], s.blocks[:full])
        self._alloc.release(s.blocks)
        s.blocks = []

    def _read(self, seqs: list[SequenceState], copy: HostCopy, done: list[tuple[int, Completion]]) -> None:
        toks, lps = copy.result()
        for s, t, lp in zip(seqs, toks, lps):
            if s.finish is not None:
                continue  # the step a finished row ran before it could leave: discarded
            s.tokens.append(t)
            s.logprobs.append(lp)
            if t in s.stops:
                s.finish = "stop"
            elif len(s.tokens) == s.max_new:
                s.finish = "length"
            else:
                continue
            self._finish(s)
            done.append((s.handle, Completion(s.request.prompt_index, s.tokens, s.logprobs, s.finish)))
