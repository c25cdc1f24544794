"""``HFPolicy``: the ``Policy`` protocol for any transformers ``AutoModelForCausalLM`` (SmolLM2, Qwen, Llama, ...).

The trainer gets token log-probs (and entropies) of given sequences, an optional value head (PPO), parameters for the
optimizer, and a state dict to push to the generator. ``state_dict()`` holds the causal LM's own keys (what a
generator loads: ``HFBackend.update_weights``, ``VLLMBackend.update_weights``) plus ``value_head.*`` entries when
there is a value head; backends drop the latter.

Shapes: ``B`` sequences, ``T`` positions, ``V`` vocabulary size, ``D`` hidden size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from sara.config import SaraModel
from sara.hub import NON_MODEL_PREFIXES, resolve_hf_model
from sara.policies.base import PolicyOutput, ScoreViews, TokenBatch

__all__ = ["HFPolicy", "HFPolicyConfig", "make_hf_policy"]


class HFPolicyConfig(SaraModel):
    """Options of the HF causal-LM policy."""

    model: str = "smollm2"
    """A model name prepared by ``sara model prepare`` (``smollm2``) or a local HF model directory."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Trainable weight dtype. float32 keeps small AdamW updates (bf16 weights round most of them away)."""
    device: str = "cpu"
    """Torch device."""
    value_head: bool = False
    """Add a scalar value head on the last hidden state (PPO / GAE)."""
    temperature: float = Field(1.0, gt=0)
    """Logits are divided by this before the log-softmax (match the sampling temperature if the loss needs it)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% slower)."""
    cache_dir: str | None = None
    """Cache root for named models (default ``$SARA_CACHE_DIR`` or ``~/.cache/sara``)."""


class HFPolicy(ScoreViews):
    """A trainable causal LM (implements ``sara.policies.base.Policy``).

    Args:
        model: A prepared model name / local HF directory, or a loaded causal-LM module (then pass ``tokenizer``).
        tokenizer: The tokenizer (loaded from the directory when ``model`` is a path or name).
        **options: ``HFPolicyConfig`` fields.
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, **options: Any) -> None:
        self.config, self.model, self.tokenizer = resolve_hf_model(model, tokenizer, options, HFPolicyConfig,
                                                                   what="policy 'hf'")
        self.model.train()
        if self.config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        hidden = int(self.model.config.hidden_size)
        self.value_head: nn.Linear | None = None
        if self.config.value_head:
            self.value_head = nn.Linear(hidden, 1).to(device=self.device, dtype=torch.float32)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    @property
    def has_value_head(self) -> bool:
        return self.value_head is not None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- Policy protocol ------------------------------------------------------------------------------------
    def _forward(self, batch: TokenBatch, hidden: bool) -> Any:
        return self.model(input_ids=batch.input_ids.to(self.device),
                          attention_mask=batch.attention_mask.to(self.device), output_hidden_states=hidden,
                          use_cache=False)

    def score(self, batch: TokenBatch, *, with_entropy: bool = False, with_values: bool = False) -> PolicyOutput:
        """One forward pass -> ``PolicyOutput`` (log-probs; entropy / values when asked), all ``[B, T]``.

        Computed in float32 whatever the weight dtype (``logsumexp`` + ``gather``, no second ``[B, T, V]`` copy
        unless the entropy is asked for).
        """
        if with_values and self.value_head is None:
            raise RuntimeError("this HFPolicy has no value head (value_head=False)")
        ids = batch.input_ids.to(self.device)
        out = self._forward(batch, hidden=with_values)
        logits = out.logits[:, :-1].float()
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
        logz = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - logz
        zero = lp.new_zeros(ids.shape[0], 1)
        ent = values = None
        if with_entropy:
            p = torch.softmax(logits, dim=-1)
            ent = torch.cat([zero, logz - (p * logits).sum(-1)], dim=1)
        if with_values:
            v = self.value_head(out.hidden_states[-1][:, :-1].float()).squeeze(-1)
            values = torch.cat([zero, v], dim=1)
        return PolicyOutput(torch.cat([zero, lp], dim=1), ent, values)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Trainable parameters: the LM's, then the value head's."""
        yield from self.model.parameters()
        if self.value_head is not None:
            yield from self.value_head.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.model.named_parameters()
        if self.value_head is not None:
            for name, p in self.value_head.named_parameters():
                yield "value_head." + name, p

    def state_dict(self) -> dict[str, Any]:
        """The LM's own state (generator-loadable keys) plus ``value_head.*`` when present."""
        state = dict(self.model.state_dict())
        if self.value_head is not None:
            state.update({"value_head." + k: v for k, v in self.value_head.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> Any:
        """Load a ``state_dict()`` (strict on the LM keys; value-head keys need a value head)."""
        lm = {k: v for k, v in state.items() if not k.startswith(NON_MODEL_PREFIXES)}
        head = {k[len("value_head."):]: v for k, v in state.items() if k.startswith("value_head.")}
        if head and self.value_head is None:
            raise ValueError("state has value_head.* entries but this HFPolicy has no value head")
        result = self.model.load_state_dict(lm, strict=True)
        if self.value_head is not None and head:
            self.value_head.load_state_dict(head)
        return result

    def train(self, mode: bool = True) -> HFPolicy:
        self.model.train(mode)
        if self.value_head is not None:
            self.value_head.train(mode)
        return self

    def eval_mode(self) -> HFPolicy:
        """Switch to inference mode (``train(False)``)."""
        return self.train(False)

    def to(self, *args: Any, **kwargs: Any) -> HFPolicy:
        self.model.to(*args, **kwargs)
        if self.value_head is not None:
            self.value_head.to(*args, **kwargs)
        return self


def make_hf_policy(options: Mapping[str, Any] | None = None, **_: Any) -> HFPolicy:
    """Policy factory: ``HFPolicy(**options)`` (``model``, ``dtype``, ``value_head``, ...)."""
    return HFPolicy(**dict(options or {}))
