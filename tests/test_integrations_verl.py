"""The verl integration without verl: it imports, its options validate, its pool indexes (the verl tests proper run in
verl's environment: ``bash .ci/verl``, ``tests/test_integrations_verl_sampler.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sara.config import ConfigError
from sara.integrations.verl import POOL_SIZE, VerlSamplerConfig
from sara.integrations.verl_env import PromptPool


def test_importing_it_loads_no_heavy_package():
    code = ("import sys, sara.integrations.verl, sara.integrations.verl_sources\n"
            "heavy = [m for m in ('verl', 'torch', 'tensordict', 'transfer_queue', 'ray', 'omegaconf') "
            "if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sampler_kwargs_validate_with_field_names():
    cfg = VerlSamplerConfig.model_validate({})
    assert (cfg.allocator, cfg.sampler, cfg.driver, cfg.k) == ("sara", "verl", "stream", None)
    from sara.config import validate_config

    with pytest.raises(ConfigError, match="no_such"):
        validate_config(VerlSamplerConfig, {"no_such": 1}, what="trainer.v1.sampler.sampler_kwargs")
    with pytest.raises(ConfigError, match="k"):
        validate_config(VerlSamplerConfig, {"k": 1}, what="trainer.v1.sampler.sampler_kwargs")


def test_the_prompt_pool_names_every_index():
    pool = PromptPool(POOL_SIZE)
    assert len(pool) == POOL_SIZE and pool[12].id == "verl-12" and [p.id for p in pool[2:4]] == ["verl-2", "verl-3"]
