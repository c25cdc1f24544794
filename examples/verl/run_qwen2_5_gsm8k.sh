#!/usr/bin/env bash
# GRPO + SARA on GSM8K with verl 0.9.1 on one GPU (not run on a GPU in this repository: docs/verl.md).
#
#   bash examples/verl/run_qwen2_5_gsm8k.sh                                     # Qwen2.5-0.5B-Instruct
#   MODEL=Qwen/Qwen2.5-1.5B-Instruct bash examples/verl/run_qwen2_5_gsm8k.sh
#   ALLOCATOR=uniform bash examples/verl/run_qwen2_5_gsm8k.sh                   # fixed groups of k, same path
#   bash examples/verl/run_qwen2_5_gsm8k.sh trainer.n_gpus_per_node=8            # any hydra override
#
# Needs: verl 0.9.1 with its vLLM extra (pip install "verl[vllm]==0.9.1" transferqueue==0.1.11), this repository
# installed (pip install -e .), and the GSM8K parquet files (written to $DATA by prepare_gsm8k.py on first run).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DATA="${DATA:-$HOME/data/gsm8k}"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
ALLOCATOR="${ALLOCATOR:-sara}"
[ -f "$DATA/train.parquet" ] || python3 "$HERE/prepare_gsm8k.py" --out "$DATA"
case "$MODEL" in *1.5B*) TOKENS=8192 ;; *) TOKENS=16384 ;; esac
exec python3 -m verl.trainer.main_ppo --config-path="$HERE" --config-name=sara_grpo_gsm8k \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$TOKENS" \
  trainer.v1.sampler.sampler_kwargs.allocator="$ALLOCATOR" \
  trainer.experiment_name="$(basename "$MODEL")_gsm8k_$ALLOCATOR" "$@"
