"""How prompt tokens reach the fused engine's KV cache: the scheduler's prefill backend (`scheduler.Backend`).

    tokens, logprobs = engine.prefill(groups, mode)       # a batch joining apart: each group's prompt once, then the
                                                          # first token of each of its sequences
    mixed = engine.join_in_step(groups, start, mode)      # single requests joining inside the next decode step

New prompts run the flash prefill (padded) or packed through the decode step's kernels (`extend`, graphed per token
bucket); prompts continuing a cached prefix (agent turns, shared prefixes) always run packed, past the cached tokens.
`PromptPath` is part of `FusedEngine` (engine.py), whose model, KV cache, runner and options it reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from hybridrl.data.images import ImageInputs
from hybridrl.engines.native.blocks import image_runs
from hybridrl.engines.native.kv_cache import SCRATCH_BLOCK, blocks_for
from hybridrl.engines.native.scheduler import PromptGroup
from hybridrl.engines.native.step_io import PackedTokens, SamplerMode, to_device
from hybridrl.engines.sampling import sample_tokens
from hybridrl.errors import HybridRLError
from hybridrl.models.vision import merged_embeddings

PACKED_PROMPT_MAX = 512
"""Where the paged attention kernel runs (GPU), new prompts up to this many tokens run packed (`_extend_chunk`: the
decode step's kernels, graphed, one launch); longer ones run the flash prefill, whose attention reads each key once
per tile of queries rather than once per query."""


class PromptPath:
    """The prefill side of `FusedEngine`: prompts into the KV cache, and their first tokens sampled."""

    def prefill(self, groups: list[PromptGroup], mode: SamplerMode) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's prompt once into its first sequence's blocks, its partly filled last block copied to the
        others, and every sequence's first token sampled (`scheduler.Backend.prefill`)."""
        logits = self._prefill_logits(groups)
        src, dst = [], []
        for g in groups:
            if len(g.prompt) % self.block_size:  # each sample writes its own copy of the partly filled block
                last = len(g.prompt) // self.block_size
                src += [g.seqs[0].blocks[last]] * (len(g.seqs) - 1)
                dst += [s.blocks[last] for s in g.seqs[1:]]
        if dst:
            self.cache.copy_blocks(to_device(src, torch.long, self.device), to_device(dst, torch.long, self.device))
        counts = [len(g.seqs) for g in groups]
        if any(c > 1 for c in counts):
            logits = logits[to_device([i for i, c in enumerate(counts) for _ in range(c)], torch.long, self.device)]
        keys = None
        if mode.seeded:
            keys = to_device([s.key for g in groups for s in g.seqs], torch.long, self.device)
        return sample_tokens(
            logits[:, : self.vocab],
            mode.temperature,
            mode.top_k,
            mode.top_p,
            self.generator,
            keys=keys,
            step=0,
            kernel=mode.kernel,
        )

    def _prefill_logits(self, groups: list[PromptGroup]) -> torch.Tensor:
        """Prefill each group's prompt, past its `cached` tokens, into its blocks (the first sequence's table, or
        `shared` for a bare group); logits [groups, padded vocab]. One forward takes ≤ engine.native.prefill_tokens
        new tokens (padded, for the flash prefill). Groups continuing a cached prefix (agent turns, shared prefixes)
        run packed (`_extend_chunk`), and so do short new prompts where the paged attention kernel runs; other new
        prompts run the flash prefill. Where the packed
        path's attention gathers each token's context (the torch path), a chunk gathers ≤ 4× prefill_tokens
        positions."""
        out, start, budget = [], 0, self.options.prefill_tokens
        gathers = not self.model.paged_attention_kernel(self.block_size)
        packed = self._packed

        def fits(chunk: list[PromptGroup]) -> bool:
            if not packed(chunk[0]):
                return len(chunk) * max(len(g.prompt) for g in chunk) <= budget
            new = sum(len(g.prompt) - g.cached for g in chunk)
            return new <= budget and (not gathers or new * max(len(g.prompt) for g in chunk) <= 4 * budget)

        while start < len(groups):
            end = start + 1
            while end < len(groups) and packed(groups[end]) == packed(groups[start]) and fits(groups[start : end + 1]):
                end += 1
            chunk = groups[start:end]
            out.append(self._extend_chunk(chunk) if packed(chunk[0]) else self._prefill_chunk(chunk))
            start = end
        return torch.cat(out) if len(out) > 1 else out[0]

    def _packed(self, g: PromptGroup) -> bool:
        """Whether the group's prompt runs packed, a row per token (`extend`, or inside a mixed step); a new prompt
        with images runs the flash prefill, one continuing a cached prefix (its images' content in the keys) packed."""
        if _images(g) is not None:
            return bool(g.cached)
        # Where the attention gathers each token's context (the torch path: no kernel, no graphs), a new prompt is
        # cheaper padded through SDPA; float32 CPU runs then also keep the golden run's numbers bit for bit.
        return bool(g.cached) or (
            self.model.paged_attention_kernel(self.block_size) and len(g.prompt) <= PACKED_PROMPT_MAX
        )

    def step_prefill_tokens(self, group: PromptGroup) -> int | None:
        """The prompt tokens a single request computes inside a mixed step: past its cached prefix, but the last (the
        row's input). None for a group of several samples (they share a copied partial block: a prefill does that) or
        a prompt the packed path does not take."""
        if len(group.seqs) != 1 or not self._packed(group) or self.model.mrope_axes is not None:
            return None  # (a multimodal-RoPE model's rows run at their rotary shifts, which mixed steps do not read)
        return len(group.prompt) - 1 - group.cached

    def join_in_step(self, groups: list[PromptGroup], start: int, mode: SamplerMode) -> PackedTokens:
        """Place single-request groups as rows start.. whose first token the next step samples, their last prompt
        token the row's input and the rest past the cached prefix computed inside that step (`PackedTokens`)."""
        seqs = [g.seqs[0] for g in groups]
        mixed = self._past_cache(groups, [s.blocks for s in seqs], start, last=False)
        self.runner.place(
            start,
            [g.prompt[-1] for g in groups],
            [len(g.prompt) - 1 for g in groups],
            [s.key for s in seqs] if mode.seeded else None,
            [s.blocks for s in seqs],
            step=0,
        )
        return mixed

    def _tables(self, groups: list[PromptGroup]) -> list[list[int]]:
        return [g.seqs[0].blocks if g.seqs else g.shared for g in groups]

    def _prefill_chunk(self, groups: list[PromptGroup]) -> torch.Tensor:
        """Prompts from position 0, right-padded into one [groups, longest] forward."""
        bs, dev = self.block_size, self.device
        tables = self._tables(groups)
        width = max(len(g.prompt) for g in groups)
        ids = torch.full((len(groups), width), self.pad_token_id, dtype=torch.long)
        slots = []
        for i, g in enumerate(groups):
            ids[i, : len(g.prompt)] = torch.as_tensor(g.prompt, dtype=torch.long)
            slots += self.cache.slots(tables[i], 0, len(g.prompt))
            # Padding tokens write into the scratch block.
            slots += [SCRATCH_BLOCK * bs + t % bs for t in range(len(g.prompt), width)]
        lengths = to_device([len(g.prompt) for g in groups], torch.long, dev)
        slots = to_device(slots, torch.long, dev).view(len(groups), width)
        ids = ids.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else ids
        if not any(_images(g) is not None for g in groups):
            return self.model.prefill(ids, lengths, slots, self.cache)
        images, mrope = self._vision_inputs(groups, width)
        return self.model.prefill(ids, lengths, slots, self.cache, images, mrope)

    def _vision_inputs(
        self, groups: list[PromptGroup], width: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor]]:
        """Of prompts right-padded to `width`: the image embeddings at their placeholders (flat token indices,
        vectors; `_images_at`) and each token's multimodal RoPE (cos, sin)."""
        images, positions = self._images_at(groups, lambda i, j: i * width + j)
        padded = torch.zeros(3, len(groups), width, dtype=torch.long)
        for i, p in enumerate(positions):
            padded[:, i, : p.shape[1]] = p
        return images, self.model.mrope_rows(padded.view(3, -1))

    def _images_at(
        self, groups: list[PromptGroup], flat: Callable[[int, int], int]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[torch.Tensor]]:
        """What the forward over the groups' prompts past their cached prefixes puts at image placeholders: (flat
        token indices by `flat(group, position)`, the vision tower's embeddings), from one tower pass over the images
        with a placeholder past the cache; and each prompt's multimodal positions [3, len]. Each sequence's rotary
        shift is set (`SequenceState.shift`)."""
        at, pixels, grids, picked = [], [], [], []
        positions, made = [], 0  # `made`: embeddings the tower makes of the images so far
        for i, g in enumerate(groups):
            imgs = _images(g)
            grid = imgs.image_grid_thw if imgs is not None else None
            p = self.mrope(g.prompt, grid)  # [3, len]
            positions.append(p)
            for s in g.seqs:
                s.shift = int(p.max()) + 1 - len(g.prompt)
            if imgs is None:
                continue
            ends = list(itertools.accumulate(int(n) for n in grid.prod(-1)))
            for k, (first, end, _) in enumerate(image_runs(g.prompt, self.mrope.image_token_id, imgs.digests)):
                if end <= g.cached:
                    continue  # its placeholders' K/V are cached: no tower pass
                pixels.append(imgs.pixel_values[ends[k] - int(grid[k].prod()) : ends[k]])
                grids.append(grid[k : k + 1])
                start = max(first, g.cached)
                at += [flat(i, j) for j in range(start, end)]
                picked += range(made + start - first, made + end - first)
                made += end - first
        if not pixels:
            return None, positions
        dev, dtype = self.device, self.model.dtype
        embeds = merged_embeddings(self.vision(torch.cat(pixels).to(dev, dtype), grid_thw=torch.cat(grids).to(dev)))
        if embeds.shape[0] != made:
            raise HybridRLError(
                f"native engine: {made} image placeholder tokens in the prompts, but their images make "
                f"{embeds.shape[0]} embeddings; the prompts' placeholders must come from the model's processor"
            )
        return (to_device(at, torch.long, dev), embeds[to_device(picked, torch.long, dev)]), positions

    def _extend_chunk(self, groups: list[PromptGroup]) -> torch.Tensor:
        """Prompts past their cached prefixes (0 for a new one), packed: each new token is a row of
        `FusedDecoder.extend`, through `DecodeRunner.extend` (a CUDA graph per token bucket on GPU)."""
        tables = self._tables(groups)
        wide = max(blocks_for(len(g.prompt), self.block_size) for g in groups)
        tokens = self._past_cache(groups, tables, 0, last=True)
        ends = list(itertools.accumulate(len(g.prompt) - g.cached for g in groups))
        last = [end - 1 for end in ends]  # each's last
        tables = [t[:wide] + [SCRATCH_BLOCK] * (wide - len(t[:wide])) for t in tables]
        if not any(_images(g) is not None for g in groups):
            return self.runner.extend(tokens, tables, last)
        # Image prompts continuing a cached prefix: their placeholders' embeddings and multimodal RoPE.
        starts = [end - (len(g.prompt) - g.cached) for g, end in zip(groups, ends)]
        images, positions = self._images_at(groups, lambda i, j: starts[i] + j - groups[i].cached)
        cos, sin = self.model.mrope_rows(torch.cat([p[:, g.cached :] for p, g in zip(positions, groups)], dim=1))
        rope = (cos, sin, torch.arange(len(tokens.ids), device=self.device))
        return self.runner.extend(tokens, tables, last, images, rope)

    def _past_cache(
        self, groups: list[PromptGroup], tables: list[list[int]], first_row: int, last: bool
    ) -> PackedTokens:
        """Each group's prompt tokens past its cached prefix, with (`last`) or without its last token, packed: ids,
        positions, cache slots in the group's table, and the row of that table (first_row + the group's index)."""
        out = PackedTokens([], [], [], [])
        for row, (g, table) in enumerate(zip(groups, tables), first_row):
            end = len(g.prompt) - (0 if last else 1)
            out.ids += g.prompt[g.cached : end]
            out.pos += range(g.cached, end)
            out.slots += self.cache.slots(table, g.cached, end)
            out.rows += [row] * (end - g.cached)
        return out


def _images(g: PromptGroup) -> ImageInputs | None:
    """The group's images (its requests share them), or None for a text prompt."""
    return g.seqs[0].request.images if g.seqs else None
