"""``sara bench population`` on the tiny policy: rates of the starting policy and of a checkpoint (whose own config,
here k=4, decides the group size), group shares that follow from the rates, and the rules' figures on them."""

from __future__ import annotations

import json

import numpy as np

from sara.cli import main

TASK = "sara/Arithmetic-v0:max_digits=2,ops=+,pool_size=400,eval_size=20"


def test_start_and_checkpoint_populations(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"task: '{TASK}'\nk: 4\ngroups_per_step: 2\nsteps: 1\ncheckpoint_every: 1\n"
                   "eval: {every: 0, num_prompts: 8}\n")
    out = tmp_path / "start.json"
    assert main(["bench", "population", "--config", str(cfg), "--prompts", "24", "--samples", "4",
                 "--json", str(out)]) == 0
    start = json.loads(out.read_text())
    rates = np.array(start["rates"])
    assert start["k"] == 4 and len(rates) == 24 and set(np.unique(rates * 4)) <= set(range(5))
    assert np.isclose(start["solved"], np.mean(rates ** 4)) and np.isclose(start["unsolved"], np.mean((1 - rates) ** 4))
    assert np.isclose(start["solved"] + start["unsolved"] + start["mixed"], 1.0)
    assert set(start["population"]) == {"ds", "paper", "optimal"}
    assert start["population"]["optimal"]["rollouts_per_effective_group"] <= \
        start["population"]["ds"]["rollouts_per_effective_group"] + 1e-9  # the optimal rule never costs more than DS
    assert "| mixed |" in capsys.readouterr().out
    tok = start["tokens"]  # the tiny policy's answers are a few characters: finite means where there are rollouts
    assert tok["all"] > 0 and set(tok) == {"all", "right", "wrong", "solved", "unsolved", "mixed"}

    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(run), "--quiet"]) == 0
    (ckpt,) = sorted((run / "checkpoints").glob("ckpt-*.pt"))
    out2 = tmp_path / "ckpt.json"
    assert main(["bench", "population", "--checkpoint", str(ckpt), "--prompts", "24", "--samples", "4",
                 "--json", str(out2)]) == 0
    after = json.loads(out2.read_text())
    assert after["k"] == 4 and after["config"]["checkpoint"] == str(ckpt) and len(after["rates"]) == 24


def test_token_figures_split_rollouts_by_outcome():
    from sara.bench.population import token_figures

    rewards = np.array([[1, 1], [0, 0], [1, 0]], float)
    tokens = np.array([[10, 20], [40, 60], [30, 50]], float)
    t = token_figures(rewards, tokens)
    assert t["all"] == 35 and t["right"] == 20 and t["wrong"] == 50
    assert t["solved"] == 15 and t["unsolved"] == 50 and t["mixed"] == 40
    assert np.isnan(token_figures(np.zeros((1, 2)), np.ones((1, 2)))["right"])
