"""No silent wait: a run says what it is doing between its step records (``sara.train.progress``,
``MetricsLogger.live``): each evaluation as it starts (with the last one's duration), a step's collection as its units
close (rollouts, tokens, effective groups of the target), and the update when the collection ends."""

from __future__ import annotations

import re

import pytest

from sara.metrics import MetricsLogger

pytest.importorskip("torch")

SETTINGS = ["task=sara/Arithmetic-v0:max_digits=2,pool_size=400,eval_size=40",
            "policy_options={d_model: 32, n_layers: 1, n_heads: 2, warm_start: {steps: 30, batch_size: 32}}",
            "groups_per_step=4", "k=4", "steps=2", "eval.num_prompts=8", "eval.samples=2", "eval.every=1",
            "threads=1", "tensorboard=false"]


def test_a_run_says_what_it_does_between_records(tmp_path, monkeypatch):
    from sara.train import TrainConfig, Trainer, apply_overrides

    said: list[tuple[str, bool]] = []
    records: list[int] = []
    monkeypatch.setattr(MetricsLogger, "live", lambda self, text, force=False: said.append((text, force)))
    real_log = MetricsLogger.log

    def log(self, step, metrics):
        said.append((f"<record {step}>", True))
        records.append(step)
        real_log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    cfg = TrainConfig(**apply_overrides({}, SETTINGS), out_dir=str(tmp_path), progress=True)
    with Trainer(cfg, verbose=False) as trainer:
        trainer.train()
    texts = [t for t, _ in said]
    assert texts[:3] == ["evaluating 16 held-out completions", "evaluating 8 greedy held-out completions",
                         "<record 0>"]  # before step 1's bar moves
    for step in (1, 2):
        start, rec = texts.index(f"step {step}: collecting"), texts.index(f"<record {step}>")
        lines = texts[start:rec]
        collecting = [t for t in lines if t.startswith(f"step {step}: collecting ")]
        assert collecting, lines  # as units close
        counts = [int(re.search(r"collecting ([\d,]+) rollouts", t)[1].replace(",", "")) for t in collecting]
        assert counts == sorted(counts) and counts[-1] > 0
        done = [t for t in lines if t.startswith(f"step {step}: collected ")]
        assert len(done) == 1 and done[0].endswith("; updating") and re.search(r"(\d+)/4 effective groups", done[0])
        assert re.fullmatch(r"evaluating 16 held-out completions; the last took \d+ s", lines[-2])
        assert lines[-1] == "evaluating 8 greedy held-out completions"
    assert all(force for t, force in said if not t.startswith(("step 1: collecting ", "step 2: collecting ")))


def test_live_lines_are_rate_limited_and_silent_without_progress(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):  # the plain-text fallback: lines on stderr
        if name.startswith("tqdm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    log = MetricsLogger(tmp_path / "a", tensorboard=False, live_every=3600.0)
    log.live("one", force=True)
    log.live("two")  # within the rate limit: dropped
    log.live("three", force=True)  # a new phase: shown
    log.close()
    assert capsys.readouterr().err.splitlines() == ["one", "three"]
    quiet = MetricsLogger(tmp_path / "b", progress=False, tensorboard=False)
    quiet.live("nothing", force=True)
    quiet.close()
    assert capsys.readouterr().err == ""
