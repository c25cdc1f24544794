"""Resident memory of a ``sara train`` run, step by step, with its steady parts (docs/training.md, "Memory").

Builds the run's ``Trainer`` from a config (plus ``--set`` overrides), prints the resident set size (``VmRSS``) after
it is built and after each training step, the process peak, and the sizes of what a run keeps between steps: the
policy's weights, the AdamW state, gradients still held, the generator's copy and the HF backend's prompt-KV cache::

    python benchmarks/train_memory.py --config examples/configs/smollm2_hf_1digit.yaml --steps 3
    python benchmarks/train_memory.py --config examples/configs/smollm2_hf_1digit.yaml --steps 3 --no-trim

``--no-trim`` turns off the learner's ``malloc_trim`` after each update (``sara.train.learner._trim_heap``), to see
the heap glibc keeps otherwise.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile


def rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a TrainConfig YAML/JSON file")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE override (repeatable)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-trim", action="store_true", help="keep the heap glibc retains after each update")
    args = p.parse_args()

    import torch

    import sara.train.learner as learner_module
    from sara.train import Trainer, load_config

    if args.no_trim:
        learner_module._trim_heap = lambda: None
    out: dict[str, float] = {"imports": rss_mb()}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [*args.overrides, f"out_dir={tmp}", "progress=false", "tensorboard=false",
                                        "eval.every=0", "eval.num_prompts=1", "eval.samples=1", "eval.greedy=false"])
        with Trainer(cfg) as trainer:
            out["trainer built"] = rss_mb()
            for i in range(args.steps):
                trainer.train_step()
                out[f"after step {i + 1}"] = rss_mb()
            policy, backend = trainer.policy, trainer.backend
            out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            out["policy weights"] = tensor_mb(policy.parameters())
            out["AdamW state"] = tensor_mb(t for s in trainer.learner.optimizer.state.values() for t in s.values()
                                           if torch.is_tensor(t))
            out["gradients held"] = tensor_mb(q.grad for q in policy.parameters() if q.grad is not None)
            model = getattr(backend, "model", None)
            if model is not None and model is not getattr(policy, "model", None):
                out["generator copy"] = tensor_mb(model.parameters())
            cache = getattr(backend, "prefix_cache", None)
            if cache is not None:
                out["prompt-KV cache"] = tensor_mb(t for e in cache._entries.values() for t in [*e.keys, *e.values])
    print(json.dumps({k: round(v, 1) for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
