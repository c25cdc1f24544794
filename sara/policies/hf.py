"""``HFPolicy``: the ``Policy`` protocol for any transformers ``AutoModelForCausalLM`` (SmolLM2, Qwen, Llama, ...).

The trainer gets token log-probs (and entropies) of given sequences, an optional value head (PPO), parameters for the
optimizer, and a state dict to push to the generator. ``score_at`` is the learner's fast forward
(``sara.policies.base.PrefixScorer``): the prompt prefix every row shares is forwarded once and its keys / values
broadcast to the rows (``sara.policies.prefix``), and the vocabulary projection runs only at the scored (response)
positions; ``compute_dtype`` runs the matmuls in bfloat16 under autocast over float32 weights (``auto``, the
default: where the device multiplies bfloat16 natively, ``sara.machine``). ``state_dict()`` holds the causal LM's own
keys (what a generator loads: ``HFBackend.update_weights``, ``VLLMBackend.update_weights``) plus ``value_head.*`` entries when
there is a value head; backends drop the latter.

Shapes: ``B`` sequences, ``T`` positions, ``V`` vocabulary size, ``D`` hidden size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from sara.config import MIN_TEMPERATURE, SaraModel
from sara.hub import NON_MODEL_PREFIXES, resolve_hf_model
from sara.machine import DtypeChoice, resolve_dtype
from sara.policies.base import PolicyOutput, PrefixKV, ScoreViews, TokenBatch
from sara.policies.vocab import token_logprobs

__all__ = ["HFPolicy", "HFPolicyConfig", "decoder_activation_bytes", "make_hf_policy"]


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
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE)
    """Logits are divided by this before the log-softmax (match the sampling temperature if the loss needs it); at
    least ``sara.config.MIN_TEMPERATURE``."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of the forward / backward matmuls. ``bfloat16``: autocast over the ``dtype`` weights (float32 master
    weights and AdamW state; log-softmax and losses stay float32). ``auto``: bfloat16 where the device multiplies
    bfloat16 natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX usable by oneDNN), else float32
    (``sara.machine.resolve_dtype``). bfloat16 weights (``dtype``) compute in bfloat16 whatever this says."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% slower; no shared-prefix forward)."""
    cache_dir: str | None = None
    """Cache root for named models (default ``$SARA_CACHE_DIR`` or ``~/.cache/sara``)."""

    def compute_choice(self) -> DtypeChoice:
        """The dtype the learner's matmuls run in on ``device``, and why (``auto`` resolved by ``sara.machine``;
        forcing bfloat16 where it is not native warns once)."""
        if self.dtype == "bfloat16":
            return DtypeChoice("bfloat16", f"{resolve_dtype('bfloat16', self.device).reason}; bfloat16 weights")
        choice = resolve_dtype(self.compute_dtype, self.device)
        if choice.name == "bfloat16":
            return DtypeChoice("bfloat16", f"{choice.reason}; autocast over {self.dtype} weights")
        return choice

    def activation_bytes_per_token(self) -> int | None:
        """What ``HFPolicy.activation_bytes_per_token`` will say, read from the model directory's ``config.json``
        without loading the model (None: a named model not prepared yet, or an unreadable config)."""
        from sara.hub import model_shape

        shape = model_shape(self.model, self.cache_dir)
        if shape is None:
            return None
        half = self.dtype == "bfloat16" or self.compute_choice().name == "bfloat16"
        return _shape_bytes(shape, half=half, checkpointing=self.gradient_checkpointing)


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
        self.compute = self.config.compute_choice()  # the learner's dtype and why (what a run prints and records)
        if self.config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.vocab_chunk: int | None = None
        """Rows of ``score_at``'s vocabulary projection per chunk (None: ``sara.policies.vocab.chunk_rows``)."""
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

    def activation_bytes_per_token(self) -> int | None:
        """``SizesActivations``: ``decoder_activation_bytes`` of the model's shape in the compute dtype (None: a
        config without ``hidden_size``, ``intermediate_size`` or ``num_hidden_layers``)."""
        half = self.autocast_dtype is not None or next(self.model.parameters()).dtype != torch.float32
        return _shape_bytes(self.model.config.to_dict(), half=half, checkpointing=self.config.gradient_checkpointing)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the matmuls run in under autocast, or None when they run in the weights' dtype."""
        weights = next(self.model.parameters()).dtype
        return torch.bfloat16 if self.compute.name == "bfloat16" and weights != torch.bfloat16 else None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

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
        with self._autocast():
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

    def score_at(self, batch: TokenBatch, at: torch.Tensor, *, prefix_len: int = 0, with_entropy: bool = False,
                 with_values: bool = False, prefix: PrefixKV | None = None) -> PolicyOutput:
        """``PrefixScorer.score_at``: outputs ``[B, R]`` at positions ``at [B, R]``, the shared prefix forwarded once.

        The ``P = prefix_len`` leading tokens run as one row (with gradient, ``use_cache``); its per-layer keys /
        values are broadcast to the ``B`` rows (``sara.policies.prefix.broadcast_cache``), which then run their
        ``T - P`` remaining positions at positions ``P..T-1`` (right padding: a real token never attends to a pad).
        Hidden states ``[K, D]`` of the ``K`` counted positions' predecessors go through the LM head, ``vocab_chunk``
        rows at a time with the logits recomputed in the backward (``sara.policies.vocab.token_logprobs``): no
        ``[K, V]`` (let alone ``[B, T, V]``) logits are kept or made. Positions whose ``response_mask`` is 0 get 0.
        With ``prefix`` (``prefix_kv``) only tokens ``prefix.length..P-1`` of the prefix run, on top of its keys /
        values. Under gradient checkpointing nothing is shared (P = 0, ``prefix`` unused).

        Raises:
            ValueError: a scored position not after the prefix, or a ``prefix`` longer than ``prefix_len``.
        """
        if with_values and self.value_head is None:
            raise RuntimeError("this HFPolicy has no value head (value_head=False)")
        dev = self.device
        ids, attn, at = batch.input_ids.to(dev), batch.attention_mask.to(dev), at.to(dev)
        rows, cols = ((batch.response_mask.to(dev).gather(1, at) > 0) & (at > 0)).nonzero(as_tuple=True)
        pos = at[rows, cols]  # [K] positions scored
        p = prefix_len if prefix_len > 0 and not self.model.is_gradient_checkpointing else 0
        if rows.numel() and int(pos.min()) <= p:
            raise ValueError(f"score_at: prefix_len {p} reaches a scored position ({int(pos.min())}); every scored "
                             "position must come after the prefix")
        given = None if p == 0 or prefix is None else prefix
        if given is not None and given.length > p:
            raise ValueError(f"score_at: the given prefix ({given.length} tokens) is longer than prefix_len {p}")
        # a checkpointed layer recomputes in the backward, outside this context: it must pick the default kernel
        pairs = 0 if self.model.is_gradient_checkpointing else (ids.shape[1] - p) * ids.shape[1]
        with self._autocast(), _attention_kernel(pairs, dev):
            hidden = self._hidden(ids, attn, p, given)  # [B, T - P, D]
            h = hidden[rows, pos - 1 - p]  # [K, D]: the state before each scored token
        lp_k, ent_k = token_logprobs(h, ids[rows, pos], self.model.get_output_embeddings(), self._finish_logits,
                                     dtype=self.autocast_dtype, with_entropy=with_entropy, chunk=self.vocab_chunk)
        shape = at.shape

        def place(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(shape, dtype=x.dtype, device=dev).index_put((rows, cols), x)

        lp = place(lp_k)
        ent = None if ent_k is None else place(ent_k)
        values = None
        if with_values:
            values = place(self.value_head(h.float()).squeeze(-1))
        return PolicyOutput(lp, ent, values)

    def prefix_kv(self, batch: TokenBatch, prefix_len: int) -> PrefixKV | None:
        """``PrefixScorer.prefix_kv``: row 0's first ``prefix_len`` tokens forwarded once (under the policy's autocast,
        with gradient when enabled); None under gradient checkpointing (``score_at`` shares nothing there)."""
        if prefix_len <= 0 or self.model.is_gradient_checkpointing:
            return None
        from sara.policies.prefix import prefix_layers

        ids = batch.input_ids.to(self.device)
        with self._autocast(), _attention_kernel(prefix_len * prefix_len, self.device):
            layers = prefix_layers(self.model, ids, prefix_len)
        return PrefixKV(prefix_len, [x for kv in layers for x in kv])

    def _hidden(self, ids: torch.Tensor, attn: torch.Tensor, p: int, given: PrefixKV | None = None) -> torch.Tensor:
        """Final hidden states ``[B, T - p, D]`` of positions ``p..T-1`` (``sara.policies.prefix.final_hidden``), on
        top of ``given``'s keys / values when set."""
        from sara.policies.prefix import final_hidden

        if given is None:
            return final_hidden(self.model, ids, attn, p)
        x = given.tensors
        return final_hidden(self.model, ids, attn, p, list(zip(x[0::2], x[1::2])), given.length)

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the causal LM does to its head's output (a final soft cap, e.g. Gemma 2), then the temperature."""
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
        return logits

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


_MATH_ATTENTION_PAIRS = 1 << 14
"""Query-key pairs per row and head up to which ``score_at`` runs attention with the plain (math) SDPA kernel on a
CPU: its backward is faster than the CPU flash kernel's on short rows, the flash kernel's on long ones (the crossover
on SmolLM2-135M in bfloat16 is measured in docs/results.md, "The learner at this length"). The count is per row: rows
after a long given prefix attend to it and take the flash kernel, whatever the micro-batch's size."""


def _shape_bytes(shape: Mapping[str, Any], *, half: bool, checkpointing: bool) -> int | None:
    try:
        dims = [int(shape[key]) for key in ("hidden_size", "intermediate_size", "num_hidden_layers")]
    except (KeyError, TypeError, ValueError):
        return None
    return decoder_activation_bytes(*dims, half=half, checkpointing=checkpointing)


def decoder_activation_bytes(hidden: int, intermediate: int, layers: int, *, half: bool,
                               checkpointing: bool = False) -> int:
    """Bytes one forwarded position keeps for the backward in a decoder-only transformer (an estimate).

    Per layer about ``11 x hidden + 4.5 x intermediate`` values: the two norms' inputs and outputs, the query, the
    keys and values repeated to every attention head, the attention output, the MLP's gate, up, activation and
    product, and the kernels' own saved statistics and workspaces. 4 bytes each in float32; 2.75 on average under
    half-precision autocast (the norms, residual stream and softmax statistics stay float32). Under gradient
    checkpointing a layer keeps only its input, and one layer at a time holds the rest during its recomputation.

    Args:
        hidden: The model's hidden size.
        intermediate: The MLP's inner size.
        layers: Decoder layers.
        half: The matmuls run under bfloat16 / float16 autocast (or in half-precision weights).
        checkpointing: Gradient checkpointing is on.
    """
    per_layer = (11 * hidden + 4.5 * intermediate) * (2.75 if half else 4.0)
    if checkpointing:
        return int(layers * hidden * 4 + per_layer)
    return int(layers * per_layer)


def _attention_kernel(pairs: int, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The SDPA kernel choice for a forward with ``pairs`` query-key pairs per row and head (see
    ``_MATH_ATTENTION_PAIRS``; 0: the default kernels)."""
    if device.type != "cpu" or pairs <= 0 or pairs > _MATH_ATTENTION_PAIRS:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def make_hf_policy(options: Mapping[str, Any] | None = None, **_: Any) -> HFPolicy:
    """Policy factory: ``HFPolicy(**options)`` (``model``, ``dtype``, ``value_head``, ...)."""
    return HFPolicy(**dict(options or {}))
