"""GSM8K as verl's RL parquet files (train.parquet, test.parquet) for examples/verl/sara_grpo_gsm8k.yaml.

    python examples/verl/prepare_gsm8k.py --out ~/data/gsm8k

Each row is what verl's ``RLHFDataset`` reads: ``prompt`` (chat messages), ``data_source`` ``openai/gsm8k`` (verl's
rule-based scorer ``verl.utils.reward_score.gsm8k``: the number after ``####``), ``reward_model.ground_truth`` and
``extra_info.index`` (the prompt's identity: sara's pool index, so its per-prompt priors follow the prompt).
Downloads ``openai/gsm8k`` through ``datasets`` on first use.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def to_row(example: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    """One GSM8K example (``question``, ``answer`` ending in ``#### <number>``) as a verl RL row."""
    answer = example["answer"].split("####")[-1].strip().replace(",", "")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": example["question"], "answer": example["answer"]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.expanduser("~/data/gsm8k"), help="directory of the parquet files")
    args = ap.parse_args()
    import datasets

    os.makedirs(args.out, exist_ok=True)
    for split in ("train", "test"):
        ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
        ds = ds.map(lambda ex, i, split=split: to_row(ex, i, split), with_indices=True, remove_columns=ds.column_names)
        path = os.path.join(args.out, f"{split}.parquet")
        ds.to_parquet(path)
        print(f"{split}: {len(ds)} rows -> {path}")


if __name__ == "__main__":
    main()
