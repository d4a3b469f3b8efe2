"""``deployments.api`` checks that need no Prefect server: what ``start_run`` accepts as a config,
and the deployment-name errors raised before any API call."""

from __future__ import annotations

import pytest

from deployments.api import _as_config, start_run
from miles_core.config import RunConfig


def test_a_config_is_a_run_config_a_dict_or_a_toml_file(tmp_path):
    cfg = RunConfig(name="x")
    assert _as_config(cfg) is cfg
    assert _as_config({"name": "y", "rollout": {"num_rollout": 2}}).rollout.num_rollout == 2
    path = tmp_path / "run.toml"
    path.write_text('name = "z"\n[rollout]\nnum_rollout = 5\n')
    assert _as_config(path).name == "z" and _as_config(str(path)).rollout.num_rollout == 5


def test_a_bad_config_is_refused_with_its_field():
    with pytest.raises(ValueError, match="(?s)start_run.*num_rolout"):
        _as_config({"rollout": {"num_rolout": 2}})
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        _as_config("missing.toml")
    with pytest.raises(TypeError, match="RunConfig, a dict .* not int"):
        _as_config(3)


def test_a_deployment_name_is_flow_slash_deployment_and_matches_the_config():
    with pytest.raises(ValueError, match="'flow/deployment'"):
        start_run(RunConfig(), deployment="my-deployment")
    with pytest.raises(ValueError, match="'train-multi-lora' flow, but this config is for 'train'"):
        start_run(RunConfig(), deployment="train-multi-lora/nightly")
