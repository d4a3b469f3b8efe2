"""HFEngine: the engine contract on the tiny model, plus what is particular to the in-process engine."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from contract.engine_contract import (
    PROMPTS,
    EngineContract,
    greedy_params,
    perturbed_state,
    requests,
    save_snapshot,
    seeded_params,
)

from miles_core.config import HFEngineConfig
from miles_core.engines import setup_engine
from miles_core.engines.base import GenerateRequest, SamplingParams

torch.set_num_threads(1)
# ``contract`` resolves because pytest puts tests/ (home of the rootless conftest.py) on sys.path.


class TestHFEngineContract(EngineContract):
    def make_engine(self, model_dir: str, seed: int = 0):
        from miles_core.engines.hf import HFEngine

        return HFEngine(model_dir, HFEngineConfig(max_batch_size=64), seed=seed)


@pytest.fixture
def engine(tiny_model_dir):
    eng = setup_engine(HFEngineConfig(), str(tiny_model_dir), "float32", 0)
    yield eng
    asyncio.run(eng.close())


def test_setup_engine_builds_the_hf_engine(engine):
    from miles_core.engines.hf import HFEngine

    assert isinstance(engine, HFEngine)
    assert engine.tokenizer.eos_token_id == 1


def test_setup_engine_rejects_an_unknown_config(tiny_model_dir):
    with pytest.raises(TypeError, match="no rollout engine for config dict"):
        setup_engine({"type": "hf"}, str(tiny_model_dir))


def test_load_adapter_is_not_implemented_yet(engine):
    with pytest.raises(NotImplementedError, match="training-backends issue"):
        asyncio.run(engine.load_adapter("a", "memory://a"))
    with pytest.raises(ValueError, match="adapter 'a'"):
        asyncio.run(engine.generate([GenerateRequest([5], adapter="a")]))


def test_batch_size_does_not_change_outputs(tiny_model_dir, engine):
    small = setup_engine(HFEngineConfig(max_batch_size=2), str(tiny_model_dir))
    tok = engine.tokenizer
    reqs = requests(tok, greedy_params(), PROMPTS * 2) + requests(tok, seeded_params(), PROMPTS)
    assert [r.output_ids for r in asyncio.run(small.generate(reqs))] == [
        r.output_ids for r in asyncio.run(engine.generate(reqs))
    ]


def test_update_weights_from_a_memory_folder(engine, tmp_path):
    import fsspec

    before = asyncio.run(engine.generate(requests(engine.tokenizer, seeded_params())))
    path = save_snapshot(perturbed_state(engine.model), tmp_path / "model.safetensors", drop_tied=True)
    with fsspec.open("memory://snapshots/v3/model.safetensors", "wb") as f:
        f.write(path.read_bytes())
    asyncio.run(engine.update_weights("memory://snapshots/v3", 3))
    after = asyncio.run(engine.generate(requests(engine.tokenizer, seeded_params())))
    assert engine.weight_version == 3
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    with pytest.raises(FileNotFoundError, match="memory://snapshots/none"):
        asyncio.run(engine.update_weights("memory://snapshots/none", 4))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(stop=("",)), "stop strings"),
    ],
)
def test_bad_sampling_params_raise(engine, bad, message):
    with pytest.raises(ValueError, match=message):
        asyncio.run(engine.generate(requests(engine.tokenizer, SamplingParams(**bad))))


def test_sample_tokens_by_hand():
    from miles_core.engines.hf import sample_tokens

    # probabilities [0.5, 0.3, 0.15, 0.05]; T = 1 keeps them
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]]).repeat(2, 1)
    # top_p = 0.7: mass before each token is [0, 0.5, 0.8, 0.95], so the nucleus is {0, 1};
    # renormalised cdf [0.625, 1]: u = 0.6 picks token 0, u = 0.63 picks token 1
    p = SamplingParams(temperature=1.0, top_p=0.7)
    tokens, logprobs = sample_tokens(logits, p, torch.tensor([0.6, 0.63], dtype=torch.float64))
    assert tokens.tolist() == [0, 1]
    # reported logprobs are untruncated: log 0.5 and log 0.3 (not log 0.625, log 0.375)
    assert logprobs.tolist() == pytest.approx([math.log(0.5), math.log(0.3)], abs=1e-6)
    # top_k = 3: cdf [0.5, 0.8, 0.95] / 0.95 = [0.526, 0.842, 1]: u = 0.99 picks token 2, never 3
    tokens, _ = sample_tokens(logits, SamplingParams(top_k=3), torch.tensor([0.99, 0.9999999], dtype=torch.float64))
    assert tokens.tolist() == [2, 2]
    # T = 0.5 squares and renormalises: [0.25, 0.09, ...] / 0.365; logprob log(0.25 / 0.365)
    zeros = torch.zeros(2, dtype=torch.float64)
    tokens, logprobs = sample_tokens(logits, SamplingParams(temperature=0.5), zeros)
    total = 0.25 + 0.09 + 0.0225 + 0.0025
    assert tokens.tolist() == [0, 0]
    assert logprobs.tolist() == pytest.approx([math.log(0.25 / total)] * 2, abs=1e-6)
