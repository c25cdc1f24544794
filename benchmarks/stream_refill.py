"""HF backend: synchronous rounds vs the streaming slot-refill loop on completions of uneven length.

``rows`` completions with caps drawn uniformly from ``[min_cap, max_cap]`` (a random-init model rarely stops early,
so the caps set the lengths) are generated three ways, on one backend:

- ``rounds``: ``generate`` calls of ``slots`` completions each (every round drains to its longest completion),
- ``stream``: ``submit`` / ``poll`` with ``slots`` in flight, a slot refilled the moment its completion finishes,
- ``one_batch``: one ``generate`` over all rows (``max_batch_size = rows``, a batch ``rows / slots`` times larger).

The passes alternate ``--repeats`` times; each keeps its fastest. ``--check-exact`` first streams 16 completions
through 6 slots in float32 and counts those equal to ``generate``'s token for token.

Usage (docs/backends.md's H200 numbers: the first command's workload, run as a one-off script before it was
packaged here)::

    python benchmarks/stream_refill.py --model smollm2 --random-init --device cuda --rows 256 --slots 64 --check-exact
    OMP_NUM_THREADS=1 python benchmarks/stream_refill.py --model smollm2 --rows 32 --slots 8 --max-cap 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="prepared model name or HF model directory")
    ap.add_argument("--random-init", action="store_true", help="the model's config with random weights")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--min-cap", type=int, default=16)
    ap.add_argument("--max-cap", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--check-exact", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="runs/bench-stream-refill.json")
    args = ap.parse_args()

    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sara.backends.hf import HFBackend
    from sara.envs.base import GenerationRequest, SamplingConfig
    from sara.hub import resolve_model

    path = resolve_model(args.model, None)
    tok = AutoTokenizer.from_pretrained(path)

    def model(dtype: Any) -> Any:
        torch.manual_seed(args.seed)
        if args.random_init:
            m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        else:
            m = AutoModelForCausalLM.from_pretrained(path)
        return m.to(dtype=dtype, device=args.device).eval()

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    rng = np.random.default_rng(args.seed)
    prompts = [f"Question {i}: " + "word " * (3 + 5 * i) for i in range(16)]
    report: dict[str, Any] = {"model": args.model, "random_init": args.random_init, "device": args.device,
                              "rows": args.rows, "slots": args.slots, "caps": [args.min_cap, args.max_cap]}
    if args.check_exact:
        b32 = HFBackend(model(torch.float32), tok, stream_slots=6)
        sp = SamplingConfig(max_new_tokens=40)
        items = [(i, GenerationRequest(prompt=prompts[i], seeds=(100 + i,), max_new_tokens=int(rng.integers(5, 40))))
                 for i in range(16)]
        b32.submit(items, sp)
        got: dict[int, Any] = {}
        while b32.inflight():
            got.update(b32.poll())
        same = sum(got[t].token_ids == b32.generate([r], sp)[0][0].token_ids for t, r in items)
        report["float32_stream_equals_generate"] = f"{same}/{len(items)}"
        del b32
    m = model(torch.bfloat16)
    b = HFBackend(m, tok, max_batch_size=args.slots, stream_slots=args.slots)
    big = HFBackend(m, tok, max_batch_size=args.rows)
    caps = rng.integers(args.min_cap, args.max_cap + 1, size=args.rows)
    reqs = [GenerationRequest(prompt=prompts[i % 16], seeds=(i,), max_new_tokens=int(caps[i]))
            for i in range(args.rows)]
    sp = SamplingConfig(max_new_tokens=args.max_cap)
    b.generate(reqs[:8], SamplingConfig(max_new_tokens=8))  # warm-up

    def rounds() -> int:
        return sum(c.num_tokens for lo in range(0, args.rows, args.slots)
                   for o in b.generate(reqs[lo: lo + args.slots], sp) for c in o)

    def stream() -> int:
        todo, n = list(enumerate(reqs)), 0
        while todo or b.inflight():
            free = args.slots - b.inflight()
            if free > 0 and todo:
                b.submit(todo[:free], sp)
                todo = todo[free:]
            n += sum(c.num_tokens for _, c in b.poll())
        return n

    def one_batch() -> int:
        return sum(c.num_tokens for o in big.generate(reqs, sp) for c in o)

    for _ in range(args.repeats):
        for name, fn in (("rounds", rounds), ("stream", stream), ("one_batch", one_batch)):
            sync()
            t0 = time.perf_counter()
            n = fn()
            sync()
            sec = time.perf_counter() - t0
            if name not in report or n / sec > report[name]["tok_per_s"]:
                report[name] = {"tokens": n, "seconds": round(sec, 3), "tok_per_s": round(n / sec, 1)}
    report["stream_vs_rounds"] = round(report["stream"]["tok_per_s"] / report["rounds"]["tok_per_s"], 3)
    report["stream_vs_one_batch"] = round(report["stream"]["tok_per_s"] / report["one_batch"]["tok_per_s"], 3)
    print(json.dumps(report, indent=2))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
