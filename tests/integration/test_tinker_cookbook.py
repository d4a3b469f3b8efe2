"""tinker-cookbook recipes, unmodified, train through ``miles tinker-serve``, in the cookbook's own
environment (``scripts/setup-tinker-cookbook.sh``, which ``scripts/test.sh`` builds): the cookbook's
RL loop (``tinker_cookbook.rl.train.main``) on the toy addition task (``examples/tinker_toy_rl.py``),
whose reward rises, and its supervised loop (``tinker_cookbook.supervised.train.main``) on right
answers (``examples/tinker_toy_sft.py``), whose final checkpoint answers held-out problems better."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

import pytest

from tinker_serving import KEY, REPO, tinker_serve

pytestmark = pytest.mark.integration


def _cookbook_python() -> str:
    out = subprocess.run([str(REPO / "scripts" / "setup-tinker-cookbook.sh")], capture_output=True, text=True)
    assert out.returncode == 0, f"scripts/setup-tinker-cookbook.sh failed:\n{out.stderr[-3000:]}"
    return str(REPO / out.stdout.strip().splitlines()[-1])


def test_the_cookbook_rl_loop_raises_the_reward(tmp_path: Path) -> None:
    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    python = _cookbook_python()
    folder = str(Path(ensure_model(ModelConfig(), log=lambda *_: None)).resolve())
    log_path = tmp_path / "rl"
    with tinker_serve(tmp_path / "store") as (url, _):
        env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": str(REPO)}
        done = subprocess.run([python, str(REPO / "examples" / "tinker_toy_rl.py"), f"base_url={url}",
                               f"model_name={folder}", f"log_path={log_path}", "max_steps=15", "learning_rate=1e-3"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    reward = [r["env/all/reward/total"] for r in rows]
    assert len(reward) == 15 and all(r["env/all/total_episodes"] == 256 for r in rows)
    # the warm-started tiny model answers ~0.25 of these; 15 steps of RL lift it well past that
    first, last = statistics.fmean(reward[:3]), statistics.fmean(reward[-5:])
    assert last > first + 0.15, reward


def test_the_cookbook_supervised_loop_teaches_the_right_sums(tmp_path: Path) -> None:
    import tinker
    from tinker import types

    from miles_core.config import ModelConfig, ToyDataConfig
    from miles_core.data.toy import toy_problems, toy_reward
    from miles_core.models import ensure_model

    python = _cookbook_python()
    folder = str(Path(ensure_model(ModelConfig(), log=lambda *_: None)).resolve())
    log_path = tmp_path / "sft"
    held_out = toy_problems(ToyDataConfig(), "test", 64)
    with tinker_serve(tmp_path / "store") as (url, _):
        env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": str(REPO)}
        done = subprocess.run([python, str(REPO / "examples" / "tinker_toy_sft.py"), f"base_url={url}",
                               f"model_name={folder}", f"log_path={log_path}", "max_steps=20"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
        nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
        assert len(nll) == 20 and statistics.fmean(nll[-3:]) < 0.5 * statistics.fmean(nll[:3]), nll
        final = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()][-1]
        assert final["sampler_path"].startswith("tinker://"), final

        with tinker.ServiceClient(base_url=url, api_key=KEY) as service:
            tok = service.create_lora_training_client(base_model="tiny-addition", rank=8).result().get_tokenizer()
            greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[tok.eos_token_id])

            def accuracy(sampler) -> float:
                answers = [sampler.sample(types.ModelInput.from_ints(tok.encode(p["prompt"])), 1, greedy)
                           for p in held_out]
                return statistics.fmean(toy_reward(tok.decode(a.result().sequences[0].tokens, skip_special_tokens=True),
                                                   p["label"]) for a, p in zip(answers, held_out))

            before = accuracy(service.create_sampling_client(base_model="tiny-addition"))
            after = accuracy(service.create_sampling_client(model_path=final["sampler_path"]))
    assert after > before + 0.2, (before, after)
