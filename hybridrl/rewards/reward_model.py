"""Local reward models (`reward_model=`): Hugging Face sequence-classification models that score each completion.

Each is its own role on every worker, sharded like the reference and kept in host memory between reward phases.
The reward phase brings them onto the device **one at a time** (peak memory: one model, not all of them)::

    for rm in reward_models:
        rm.onload()                       # parameters to the device
        scores[rm.cfg.name] = rm.score(items)
        rm.offload()                      # back to host memory before the next one comes in

A reward model reads text, not the policy's token ids: prompt and response are rendered again with the reward
model's own tokenizer (its chat template when it has one), and the score is the head's output at the last token.
A micro-batch's sequences run packed end to end in one row, as the trainer's passes do (`training/packing.py`), so no
position is spent on padding; `trainer.padding_free=false` right-pads them instead.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.rewards.base import RewardInput

log = logging.getLogger(__name__)

#: Names a reward model cannot take: `reward/<name>` would collide with the controller's own reward metrics, or
#: with the reward function's score ("function").
RESERVED_NAMES = (
    "mean",
    "std",
    "max",
    "solve_none_frac",
    "zero_std_frac",
    "kl_penalty_mean",
    "overlong_penalty_mean",
    "generated_mean",
    "function",
)
TINY = "tiny"
"""`path` of the tiny reward model made locally."""
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class RewardModelConfig:
    """One local reward model (`reward_model.models[i].*`)."""

    name: str = ""
    """Its name in metrics (`reward/<name>`, `time/reward_model/<name>`) and in `reward.combine`; required."""
    path: Optional[str] = None
    """A Hugging Face sequence-classification folder with one label, or "tiny": the tiny reward model made locally
    (random weights: its scores mean nothing, it checks the wiring with zero downloads); required."""
    weight: float = 1.0
    """Its weight in reward.combine=sum."""
    micro_batch_size: int = 16
    """Sequences per forward."""
    max_length: int = 4096
    """Longest rendered prompt + response in its tokens; longer ones keep their last max_length tokens (the score
    is read at the last one)."""
    offload: bool = True
    """Keep it in host memory outside its turn in the reward phase (GPU only)."""
    seed: int = 1
    """Seed of the tiny reward model's random weights (path=tiny only)."""

    def check(self, where: str) -> None:
        """ConfigError naming `<where>.<key>` for a bad value."""
        if not self.name or not _NAME_RE.match(self.name):
            raise ConfigError(
                f"{where}.name must be a non-empty name of letters, digits, '_', '.', '-'; got {self.name!r}"
            )
        if self.name in RESERVED_NAMES:
            raise ConfigError(
                f"{where}.name={self.name!r} is reserved (reward/{self.name} is another metric); pick another"
            )
        if not self.path or self.path == "???":
            raise ConfigError(
                f"{where}.path is required: the folder of a sequence-classification model, or tiny "
                f"(e.g. {where.replace('[', '.').replace(']', '')}.path=/path/to/reward-model)"
            )
        if self.micro_batch_size < 1:
            raise ConfigError(f"{where}.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_length < 2:
            raise ConfigError(f"{where}.max_length must be >= 2, got {self.max_length}")


@dataclass
class RewardModelsConfig:
    """The local reward models (`reward_model=tiny`, or your own list under `reward_model.models`)."""

    models: list[RewardModelConfig] = field(default_factory=list)
    """Scored in this order, one on the device at a time; empty = no reward model."""

    def __post_init__(self) -> None:
        seen = set()
        for i, m in enumerate(self.models):
            m.check(f"reward_model.models[{i}]")
            if m.name in seen:
                raise ConfigError(f"reward_model.models[{i}].name={m.name!r} is used twice; names must be unique")
            seen.add(m.name)


def render_for_reward_model(
    item: RewardInput, tokenizer, prompt_key: str = "prompt", system_prompt: str | None = None
) -> str:
    """The text a reward model reads: the dataset's prompt (`sample[prompt_key]`: a string or chat messages) and the
    response, through the reward model's chat template when it has one, else the prompt followed by the response.
    Without the raw prompt in the sample, the policy's rendered prompt text stands in."""
    raw: Any = item.sample.get(prompt_key) if isinstance(item.sample, dict) else None
    if raw is None:
        raw = item.prompt
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
        if system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        messages.append({"role": "assistant", "content": item.response})
        return tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = raw if isinstance(raw, str) else "\n".join(str(m.get("content", "")) for m in raw)
    return prompt + item.response


def load_reward_model(path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool, where: str):
    """(model, tokenizer) of a sequence-classification folder; a one-line HybridRLError naming the path if it
    cannot be loaded or does not give one score per sequence."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # any loading failure stops the run at setup, naming the folder
        first = (str(e).strip().splitlines() or [""])[0]
        raise HybridRLError(f"{where}: cannot load the reward model at {path!r}: {type(e).__name__}: {first}") from e
    if model.config.num_labels != 1:
        arch = ", ".join(getattr(model.config, "architectures", None) or ["?"])
        raise HybridRLError(
            f"{where}: the model at {path!r} ({arch}) has num_labels={model.config.num_labels}; "
            "a reward model is a sequence classifier with one score per sequence (num_labels=1)"
        )
    return model.to(device).eval().requires_grad_(False), tokenizer


class RewardModel:
    """One reward model role: sharded, frozen, in host memory outside its turn."""

    def __init__(
        self,
        cfg: RewardModelConfig,
        path: str,
        device: torch.device,
        mesh,
        precision,
        prompt_key: str = "prompt",
        system_prompt: str | None = None,
        trust_remote_code: bool = False,
        where: str = "reward_model",
        padding_free: bool = True,
    ) -> None:
        from hybridrl.training.attention import use_packed_attention
        from hybridrl.training.fsdp import shard_model
        from hybridrl.training.offload import HostOffloader

        self.cfg, self.path, self.device = cfg, path, device
        self.prompt_key, self.system_prompt = prompt_key, system_prompt
        model, self.tokenizer = load_reward_model(path, precision.frozen_dtype, device, trust_remote_code, where)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        if model.config.get_text_config().pad_token_id is None:  # HF refuses batches without one (we pool ourselves)
            model.config.get_text_config().pad_token_id = self.pad_id
        self._head_out: torch.Tensor | None = None
        head = getattr(model, "score", None)
        if isinstance(head, torch.nn.Module):  # the decoder families' head: per-token scores before pooling
            head.register_forward_hook(self._keep_head_output)
        self.per_token_head = isinstance(head, torch.nn.Module)
        # Packing needs the per-token head (the score is read at each sequence's own last position).
        self.packed = padding_free and self.per_token_head
        if self.packed:
            use_packed_attention(model, "auto", getattr(model.config, "_attn_implementation", "sdpa"))
        self.model = shard_model(model, mesh, precision.policy)
        self.offloader = HostOffloader(
            lambda: list(self.model.parameters()), device, enabled=cfg.offload and device.type == "cuda"
        )
        self.offload()  # to host memory until its turn (built one at a time, so one is on the device at most)

    @property
    def name(self) -> str:
        """Its role name (`reward_model/<name>`)."""
        return f"reward_model/{self.cfg.name}"

    def _keep_head_output(self, _module, _inputs, output) -> None:
        self._head_out = output

    # -- memory ---------------------------------------------------------------------------
    def onload(self, wait: bool = True) -> dict[str, float]:
        """Parameters to the device (wait=False: on a side stream, joined by `score`)."""
        from hybridrl.training.offload import timed_moves

        if not wait:
            moved = self.offloader.onload(wait=False)
            return {f"offload/{self.name}/onload_gb": moved / 1e9} if moved else {}
        return timed_moves(f"offload/{self.name}/onload", self.device, self.offloader.onload)

    def offload(self) -> dict[str, float]:
        """Parameters to host memory, device memory freed before returning."""
        from hybridrl.training.fsdp import reshard_units
        from hybridrl.training.offload import timed_moves

        reshard_units(self.model)
        return timed_moves(f"offload/{self.name}/offload", self.device, self.offloader.complete)

    @property
    def resident(self) -> bool:
        """Whether any of its parameter bytes are on the device now."""
        return self.memory_stats()["params_device_gb"] > 0

    def memory_stats(self) -> dict[str, float]:
        """GiB of its parameters on the device and in host memory."""
        return self.offloader.stats("params")

    # -- scoring --------------------------------------------------------------------------
    def token_ids(self, items: list[RewardInput]) -> list[list[int]]:
        """Each item rendered and tokenized for this model, cut to its last `max_length` tokens."""
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        out = []
        for item in items:
            text = render_for_reward_model(item, self.tokenizer, self.prompt_key, self.system_prompt)
            ids = self.tokenizer(text, add_special_tokens=not templated)["input_ids"]
            out.append(ids[-self.cfg.max_length :] or [self.pad_id])
        return out

    @torch.no_grad()
    def score(self, items: list[RewardInput]) -> list[float]:
        """One score per item: the head's output at the item's last token (joins an onload in flight first)."""
        self.offloader.onload()
        self.offloader.wait()
        seqs = self.token_ids(items)
        scores: list[float] = []
        for start in range(0, len(seqs), self.cfg.micro_batch_size):
            scores.extend(self._score_micro(seqs[start : start + self.cfg.micro_batch_size]))
        return scores

    def _score_micro(self, seqs: list[list[int]]) -> list[float]:
        if not self.per_token_head:  # the model's own pooling, one unpadded row at a time: always the last token
            return [
                self.model(input_ids=torch.tensor([s], device=self.device)).logits[0, 0].float().item() for s in seqs
            ]
        if self.packed:
            return self._score_packed(seqs)
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            attn[i, : len(s)] = 1
        self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), use_cache=False)
        per_token, self._head_out = self._head_out, None
        last = torch.tensor([len(s) - 1 for s in seqs], device=per_token.device)
        return per_token[torch.arange(len(seqs), device=per_token.device), last, 0].float().cpu().tolist()

    def _score_packed(self, seqs: list[list[int]]) -> list[float]:
        """The head's output at each sequence's last token, the sequences packed in one row."""
        from hybridrl.training.packing import pack_rows

        empty = torch.zeros((len(seqs), 0), dtype=torch.long)
        packed = pack_rows(seqs, empty, empty, [0] * len(seqs), self.pad_id).to(self.device)
        self.model(**packed.model_inputs(), use_cache=False)
        per_token, self._head_out = self._head_out, None
        last = packed.cu_seqlens[1 : len(seqs) + 1].long() - 1
        return per_token[0, last, 0].float().cpu().tolist()
