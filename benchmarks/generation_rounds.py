"""Generation throughput of allocators on a real backend vs one full batch: ``sara bench generation``.

This script used to replay SARA's synchronous rounds against a backend; the command now does that and more (DS,
synchronous SARA and streaming SARA on one backend instance, each against one full batch of its own rollouts; see
``sara.bench.generation`` and docs/backends.md). The arguments are the command's::

    python benchmarks/generation_rounds.py --backend hf --groups 4 --k 8 --steps 1 --json runs/bench-generation.json
    sara bench generation --backend hf --groups 4 --k 8 --steps 1     # the same
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # the guard vLLM's spawned engine needs
    from sara.cli import main

    raise SystemExit(main(["bench", "generation", *sys.argv[1:]]))
