"""A new verifiable task in a few lines: reverse a word.

Run: python examples/custom_task.py   (from the repository root)

A task = prompts (``Prompt`` with the answer fields) + a verifier ``verify(completion, **answer) -> float | None``.
Model output is untrusted: read a bounded slice of it, never ``eval`` it. To train on a task of your own, see
examples/train_custom_task.py (a task the tiny policy can spell, trained end to end in about 25 s).
"""

import numpy as np

from sara.envs.tasks import Task, make_task, register_task
from sara.testing import check_task
from sara.types import Prompt


def verify(completion: str, *, answer: str) -> float:
    """1.0 if the first line of the completion is the reversed word."""
    lines = completion[:256].strip().splitlines()
    return float(bool(lines) and lines[0].strip() == answer)


def make_reverse_task(size: int = 200, seed: int = 0, eval_size: int = 50) -> Task:
    """Seeded prompt pool plus a held-out split; options arrive as keywords (``make_task(..., size=50)``)."""
    rng = np.random.default_rng(seed)
    words = sorted({"".join(rng.choice(list("abcdefgh"), size=int(rng.integers(3, 9))))
                    for _ in range(size + eval_size)})
    prompts = [Prompt(id=f"reverse-{i:04d}", prompt=f"Reverse the word '{w}'. Answer: ", answer={"answer": w[::-1]})
               for i, w in enumerate(words)]
    n_eval = min(eval_size, len(prompts) // 5)
    return Task(id="examples/Reverse-v0", prompts=prompts[n_eval:], eval_prompts=prompts[:n_eval], verifier=verify,
                stop=("\n",), max_new_tokens=16)


if __name__ == "__main__":
    # "module:attr" entry point: imported on first use (any importable module works, e.g. "my_pkg.tasks:make_x")
    register_task("examples/Reverse-v0", "custom_task:make_reverse_task")
    task = make_task("examples/Reverse-v0", size=100, seed=1)
    stats = check_task(task, reference=lambda p: p.answer["answer"] + "\n", gym=True)
    print(f"check_task: ok ({int(stats['prompts'])} prompts, {int(stats['eval_prompts'])} held out, "
          f"{int(stats['calls'])} verifier calls)")
