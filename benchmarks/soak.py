"""Soak: >= 10^4 `collect` steps on the simulator with random budgets, targets, allocators and injected environment
exceptions; exact accounting on every step, bounded memory (see sara.bench.soak).

Run: python benchmarks/soak.py [--steps 10000] [--seed 0] [--json OUT]
"""

import argparse
import json

from sara.bench.soak import soak

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    result = soak(args.steps, seed=args.seed)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
