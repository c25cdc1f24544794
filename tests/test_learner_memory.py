"""Memory is bounded by design: with ``OptimConfig.microbatch_tokens`` a step that trains 5x the configured batch
peaks at the same memory as a configured one (one micro-batch's activations at a time), and without the budget the
same measurement grows (so it can tell). Measured as peak RSS in a fresh subprocess per budget (large allocations
mmap'ed, so freed memory leaves the RSS), on a random 4-layer Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = r"""
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from sara.algos import make_algo
from sara.policies.hf import HFPolicy
from sara.train import Learner, OptimConfig, make_batch
from sara.types import Decision, Group, Prompt, Rollout

torch.set_num_threads(1)
torch.manual_seed(0)
budget = json.loads(sys.argv[1])
cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
policy = HFPolicy(LlamaForCausalLM(cfg), tokenizer=object(), compute_dtype="float32")
learner = Learner(policy, make_algo("grpo"), OptimConfig(lr=1e-5, microbatch_tokens=budget), seed=0)
gen = torch.Generator().manual_seed(0)
preamble = torch.randint(3, 512, (40,), generator=gen).tolist()

def groups(n):
    out = []
    for g in range(n):
        prompt = (*preamble, *torch.randint(3, 512, (6,), generator=gen).tolist())
        rs = tuple(Rollout(prompt_id=str(g), pool_index=g, completion="x", reward=float(j % 2), num_tokens=24,
                           token_ids=tuple(torch.randint(3, 512, (24,), generator=gen).tolist()),
                           logprobs=(-1.0,) * 24, prompt_token_ids=prompt) for j in range(8))
        out.append(Group(group_id=g, prompt=Prompt(id=str(g), prompt="q"), pool_index=g, rollouts=rs,
                         decision=Decision.COMMIT))
    return out

def peak_mb():  # this program's own high-water mark (ru_maxrss also counts the parent's pages held before exec)
    from sara.memory import peak_rss_mb
    return peak_rss_mb()

def step(n, s):
    b = make_batch(groups(n))
    learner.update(b, *learner.advantages(b), step=s)

step(2, 0)  # the optimizer state and the allocator's first buffers
base = peak_mb()
step(8, 1)  # the configured batch: 8 groups x k=8
one = peak_mb()
step(40, 2)  # 5x the configured batch (a surplus, say)
five = peak_mb()
print(json.dumps({"base": base, "one": one, "five": five}))
"""


def _peaks(budget: int | None) -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(budget)], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_batch_a_step_trains():
    bounded = _peaks(256)
    grow_bounded = bounded["five"] - bounded["one"]
    unbounded = _peaks(None)  # the control: one forward per mini-batch
    one_forward = unbounded["one"] - unbounded["base"]
    grow_unbounded = unbounded["five"] - unbounded["one"]
    assert one_forward > 40, unbounded  # one forward of the configured batch is visible in the RSS
    assert grow_unbounded > 2.0 * one_forward, unbounded  # and 5x the rows cost several times more without a budget
    assert grow_bounded < 0.05 * grow_unbounded, (bounded, unbounded)  # with the budget: flat
