"""The Tinker service's parts without HTTP: the SDK's protobuf messages, its loss formulas, and
training clients on a shared base (fused calls equal each client alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinker import types
from tinker.proto import request_conv, response_conv

from miles_core.tinker import losses, wire
from miles_core.tinker.wire import Datum, ForwardBackward


# ------------------------------------------------------------------------------------------ wire


def test_forward_backward_request_written_by_the_sdk_reads_back() -> None:
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 0.5]})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.7}),
        model_id="s:train:0", seq_id=4)
    body = request_conv.forward_backward_request_to_proto(request).SerializeToString()

    call = wire.parse_forward_backward(body)

    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 4, "ppo", False)
    assert call.config == {"clip_low_threshold": pytest.approx(0.7)}
    assert call.data[0].tokens.tolist() == [5, 6, 7]
    assert call.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    assert call.data[0].inputs["weights"].tolist() == [0.0, 1.0, 0.5]


def test_a_body_that_is_not_the_protobuf_is_refused_by_name() -> None:
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.parse_forward_backward(b"\xff\xff\xff not protobuf")


def test_forward_backward_output_reads_back_in_the_sdk() -> None:
    outs = [{"logprobs": np.array([-1.0, -2.0], dtype=np.float32)}, {"logprobs": np.array([-0.5], dtype=np.float32)}]

    got = response_conv.deserialize_forward_backward_output(wire.forward_backward_output(outs, {"loss:sum": 3.5}))

    assert got.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]


def test_metric_keys_without_a_reduction_are_refused() -> None:
    with pytest.raises(ValueError, match="name:reduction"):
        wire.forward_backward_output([{"logprobs": np.zeros(1)}], {"loss": 1.0})


def test_sample_response_reads_back_in_the_sdk() -> None:
    body = wire.sample_response([([3, 4], [-0.25, -1.5], "stop"), ([9], [-2.0], "length")],
                                prompt_logprobs=[float("nan"), -0.5])

    got = response_conv.deserialize_sample_response(body)

    assert [(s.tokens, s.logprobs, s.stop_reason) for s in got.sequences] == [
        ([3, 4], [-0.25, -1.5], "stop"), ([9], [-2.0], "length")]
    assert got.prompt_logprobs == [None, -0.5]  # the SDK reads NaN as "no logprob"


# ---------------------------------------------------------------------------------------- losses


def _documented(loss_fn: str, lp: np.ndarray, inputs: dict, config: dict) -> float:
    """The formulas of Tinker's documentation, written out in numpy."""
    if loss_fn == "cross_entropy":
        return float(-(lp * inputs["weights"]).sum())
    ratio = np.exp(lp - inputs["logprobs"])
    a = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return float(-(ratio * a).sum())
    clipped = np.clip(ratio, config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2))
    return float(-np.minimum(ratio * a, clipped * a).sum())


@pytest.mark.parametrize("loss_fn,config", [("cross_entropy", {}), ("importance_sampling", {}), ("ppo", {}),
                                            ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.05})])
def test_losses_follow_the_documented_formulas(loss_fn: str, config: dict) -> None:
    rng = np.random.default_rng(0)
    lp = rng.normal(-1.0, 0.5, 12)
    inputs = {"weights": rng.uniform(0, 1, 12), "logprobs": lp + rng.normal(0, 0.4, 12),  # ratios well outside 0.8-1.2
              "advantages": rng.normal(0, 1, 12)}

    got = losses.datum_loss(loss_fn, torch.tensor(lp), {k: torch.tensor(v) for k, v in inputs.items()}, config)

    assert float(got) == pytest.approx(_documented(loss_fn, lp, inputs, config), rel=1e-9)


def test_unknown_loss_and_missing_or_misfit_inputs_are_refused_by_name() -> None:
    with pytest.raises(losses.LossError, match="'cispo' is not supported.*cross_entropy"):
        losses.check_inputs("cispo", [{}], [3])
    with pytest.raises(losses.LossError, match=r"datum 0: loss 'ppo' needs loss_fn_inputs \['advantages'\]"):
        losses.check_inputs("ppo", [{"target_tokens": np.zeros(3), "logprobs": np.zeros(3)}], [3])
    with pytest.raises(losses.LossError, match=r"datum 1: loss_fn_inputs\['weights'\] has 2 values for a model input of 3"):
        ok = {"target_tokens": np.zeros(3), "weights": np.zeros(3)}
        losses.check_inputs("cross_entropy", [ok, {"target_tokens": np.zeros(3), "weights": np.zeros(2)}], [3, 3])


# --------------------------------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def tiny_folder() -> str:
    from miles_core.config import ModelConfig
    from miles_core.models import ensure_model

    return str(ensure_model(ModelConfig(path="tiny-addition"), log=lambda *_: None))


def _trainer(folder: str, clients: dict[str, int]):
    from miles_core.tinker.trainer import TinkerTrainer

    t = TinkerTrainer({"tiny": folder})
    for k, (model_id, rank) in enumerate(clients.items()):
        t.create(model_id, "tiny", rank, seed=k, train_unembed=k % 2 == 0)
    return t


def _call(model_id: str, loss_fn: str, seed: int, n_datums: int = 2) -> ForwardBackward:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n_datums):
        n = int(rng.integers(4, 9))
        tokens = rng.integers(0, 90, n + 1)
        inputs = {"target_tokens": tokens[1:], "weights": rng.uniform(0, 1, n), "advantages": rng.normal(0, 1, n),
                  "logprobs": rng.normal(-4, 0.3, n)}
        data.append(Datum(tokens[:-1].astype(np.int64), inputs))
    return ForwardBackward(model_id, 1, loss_fn, {}, False, data)


CLIENTS = {"a:train:0": 2, "a:train:1": 4, "b:train:0": 8, "b:train:1": 4}
LOSS_FNS = ["cross_entropy", "importance_sampling", "ppo", "cross_entropy"]


# ranks of the four clients, datums of each: clients of several ranks (each adapter's own small
# products), of one rank with as many datums each (one batched product over the pass's rows as they
# are), and of one rank with datums of their own number (batched over rows padded to the widest)
SHAPES = {"ranks differ": ([2, 4, 8, 4], [2, 2, 2, 2]), "one rank": ([4, 4, 4, 4], [2, 2, 2, 2]),
          "one rank, padded": ([4, 4, 4, 4], [2, 3, 2, 1])}


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_calls_of_four_clients_equal_each_client_alone(tiny_folder: str, shape: str, monkeypatch) -> None:
    from miles_core.train.adapter_bank import BankLinear

    batched = []
    real_delta = BankLinear._batched_delta
    monkeypatch.setattr(BankLinear, "_batched_delta", lambda self, *a: batched.append(1) or real_delta(self, *a))
    ranks, datums = SHAPES[shape]
    clients = dict(zip(CLIENTS, ranks, strict=True))
    torch.manual_seed(0)
    fused, alone = _trainer(tiny_folder, clients), _trainer(tiny_folder, clients)
    calls = [_call(m, fn, k, n) for k, (m, fn, n) in enumerate(zip(CLIENTS, LOSS_FNS, datums, strict=True))]

    together = fused.forward_backward(calls)
    assert bool(batched) == (len(set(ranks)) == 1)  # the path this case is about ran
    separately = [alone.forward_backward([c])[0] for c in calls]
    for (outs_f, metrics_f), (outs_a, metrics_a) in zip(together, separately, strict=True):
        assert metrics_f["loss:sum"] == pytest.approx(metrics_a["loss:sum"], rel=1e-4)
        for of, oa in zip(outs_f, outs_a, strict=True):
            np.testing.assert_allclose(of["logprobs"], oa["logprobs"], rtol=1e-4, atol=1e-5)
    grads = {m: {k: p.grad.clone() for k, p in alone.get(m).params.items()} for m in clients}
    for model_id in clients:
        for k, p in fused.get(model_id).params.items():
            _same_but_float_noise(p.grad, grads[model_id][k])
        fused.optim_step(model_id, {"learning_rate": 1e-2})
        alone.optim_step(model_id, {"learning_rate": 1e-2})

    for model_id in clients:
        pf, pa = fused.get(model_id).params, alone.get(model_id).params
        moved = max(float((p - torch.zeros_like(p)).abs().max()) for k, p in pf.items() if "lora_B" in k)
        assert moved > 0  # the step changed B (zero at the start)
        for k in pf:
            # Adam's first step moves each weight by about lr * sign(grad): where a gradient is float
            # noise its sign is a coin toss, so compare where it is not
            g = grads[model_id][k]
            real = g.abs() > 1e-2 * float(g.abs().max())
            torch.testing.assert_close(pf[k][real], pa[k][real], rtol=1e-4, atol=1e-6)


def _same_but_float_noise(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding: passes of other widths and batch shapes sum in another order,
    which moves an element by up to 2e-4 of the tensor's largest here (measured; 1e-3 leaves room)."""
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * max(float(want.abs().max()), 1e-12))


def _group_call(model_id: str, loss_fn: str, seed: int, prompt_len: int, n_samples: int) -> ForwardBackward:
    """An RL group: ``n_samples`` datums of one prompt with responses of their own."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 90, prompt_len)
    data = []
    for _ in range(n_samples):
        tokens = np.concatenate([prompt, rng.integers(0, 90, int(rng.integers(1, 6)))])
        n = len(tokens) - 1
        inputs = {"target_tokens": tokens[1:], "weights": rng.uniform(0, 1, n), "advantages": rng.normal(0, 1, n),
                  "logprobs": rng.normal(-4, 0.3, n)}
        data.append(Datum(tokens[:-1].astype(np.int64), inputs))
    return ForwardBackward(model_id, 1, loss_fn, {}, False, data)


def test_rows_sharing_a_prefix_run_it_once_and_train_as_the_plain_pass(tiny_folder: str, monkeypatch) -> None:
    from miles_core.tinker import trainer as trainer_mod

    calls = [_group_call("a:train:0", "importance_sampling", 1, 12, 4),
             _group_call("b:train:0", "cross_entropy", 2, 9, 3)]
    calls[1].data += _group_call("b:train:0", "cross_entropy", 3, 10, 2).data  # a second prompt of b's
    lens, index = trainer_mod.shared_prefixes([d.tokens for c in calls for d in c.data], ["a"] * 4 + ["b"] * 5)
    assert index.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert lens[:4].tolist() == [min(12, min(len(d.tokens) for d in calls[0].data) - 1)] * 4
    clients = {"a:train:0": 4, "b:train:0": 2}
    shared, plain = _trainer(tiny_folder, clients), _trainer(tiny_folder, clients)

    got = shared.forward_backward(calls)
    monkeypatch.setattr(trainer_mod, "MIN_SHARED_PREFIX", 10**6)  # no run shares: one plain pass
    want = plain.forward_backward(calls)

    for (outs_s, metrics_s), (outs_p, metrics_p) in zip(got, want, strict=True):
        # a sum of terms of both signs: float noise is relative to the terms, not to the sum
        assert metrics_s["loss:sum"] == pytest.approx(metrics_p["loss:sum"], rel=1e-4, abs=1e-4)
        for os_, op in zip(outs_s, outs_p, strict=True):  # prompt positions included
            np.testing.assert_allclose(os_["logprobs"], op["logprobs"], rtol=1e-4, atol=1e-5)
    for model_id in clients:
        for k, p in shared.get(model_id).params.items():
            _same_but_float_noise(p.grad, plain.get(model_id).params[k].grad)


# the prompts are longer than MIN_SHARED_PREFIX, so each group's prompt runs once in the service's pass
LONG_PROMPTS = {"Add them: 1+2=": ["3", "12", "4", "03"], "Add them: 10+5=": ["15", "5", "105", "16"]}
STEPS = ([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]], [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])


def test_an_importance_sampling_client_trains_as_miles_grpo_does(tiny_model_dir, tmp_path) -> None:
    """The cookbook's RL step through the service (``forward`` for the sampler's logprobs, then
    ``forward_backward`` with ``importance_sampling`` and group-centred advantages, ``optim_step``)
    moves the adapter as ``miles train``'s GRPO step does on the same samples from the same weights
    (LoRA on every linear layer and the head, token-mean loss, no std normalisation). Tinker's loss
    is a token sum, N times the token mean, so its AdamW gets eps * N: Adam's steps are then the same."""
    from test_trainer import FakeWeightStore

    from miles_core.config import GRPOLossConfig, LoraConfig, TrainConfig
    from miles_core.models.tiny import build_tokenizer
    from miles_core.tinker.trainer import TinkerTrainer
    from miles_core.train.base import TrainBatch
    from miles_core.train.torch_trainer import TorchTrainer
    from miles_core.types import Group, Sample

    tok = build_tokenizer()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    lora = LoraConfig(rank=4, alpha=16, target_modules=targets)
    loss = GRPOLossConfig(advantage_std_normalize=False)
    cfg = TrainConfig(lr=1e-2, adam_beta1=0.9, adam_beta2=0.95, clip_grad=0.0, global_batch_size=8,
                      micro_batch_size=8, loss=loss)
    miles = TorchTrainer(str(tiny_model_dir), cfg, FakeWeightStore(tmp_path), lora=lora)
    service = TinkerTrainer({"tiny": str(tiny_model_dir)}, lora_alpha=16)
    client = service.create("m", "tiny", 4, seed=0)
    # (PEFT also saves the head's base weight, tied to the embeddings: saved, not trained)
    assert set(client.params) == {k for k in miles.weights() if ".lora_" in k}
    with torch.no_grad():
        for k, p in client.params.items():
            p.copy_(miles.weights()[k])  # the same A (B is zero in both)

    real = {k: torch.ones_like(p, dtype=torch.bool) for k, p in client.params.items()}
    for rewards in STEPS:
        responses = [[tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in answers]
                     for answers in LONG_PROMPTS.values()]
        groups = [Group([Sample(prompt, tok.encode(prompt, add_special_tokens=False), responses[g][i], a,
                                reward=rewards[g][i], loss_mask=[1] * len(responses[g][i]), group_index=g,
                                sample_index=i)
                         for i, a in enumerate(answers)])
                  for g, (prompt, answers) in enumerate(LONG_PROMPTS.items())]
        batch = TrainBatch.from_groups(groups, temperature=1.0, loss=loss)
        data, n_tokens = [], 0
        for sample, adv in zip(batch.samples, batch.advantages, strict=True):
            tokens = np.array(sample.prompt_ids + sample.response_ids)
            response = np.arange(len(tokens) - 1) >= len(sample.prompt_ids) - 1  # positions predicting it
            n_tokens += int(response.sum())
            data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:], "advantages": np.where(response, adv, 0.0)}))
        (outs, _), = service.forward_backward([ForwardBackward("m", 1, "cross_entropy", {}, True, [
            Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"], "weights": np.ones(len(d.tokens))})
            for d in data])])
        for d, out in zip(data, outs, strict=True):  # the sampler's logprobs: the policy's own
            d.inputs["logprobs"] = out["logprobs"].astype(np.float64)
        service.forward_backward([ForwardBackward("m", 2, "importance_sampling", {}, False, data)])
        grads = {k: p.grad.clone() for k, p in client.params.items()}
        service.optim_step("m", {"learning_rate": cfg.lr, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8 * n_tokens})
        miles.step(batch)

        want = miles.weights()
        for k, p in client.params.items():
            # an Adam step is about lr * sign(grad): compare where no step's sign was float noise
            g = grads[k]
            real[k] &= (g.abs() > 1e-2 * float(g.abs().max())) | (g == 0)
            torch.testing.assert_close(p.detach()[real[k]], want[k][real[k]], rtol=1e-3, atol=1e-5,
                                       msg=lambda m, k=k: f"{k}: {m}")
    assert any(float(p.abs().max()) > 0 for k, p in client.params.items() if "lora_B" in k)


def test_gradients_add_up_across_calls_until_the_optimizer_step(tiny_folder: str) -> None:
    two, one = _trainer(tiny_folder, {"m": 4}), _trainer(tiny_folder, {"m": 4})
    first, second = _call("m", "cross_entropy", 1), _call("m", "cross_entropy", 2)
    both = ForwardBackward("m", 1, "cross_entropy", {}, False, first.data + second.data)

    two.forward_backward([first])
    two.forward_backward([second])
    one.forward_backward([both])

    for k, p in two.get("m").params.items():  # the passes pad to other widths, so sums round differently
        _same_but_float_noise(p.grad, one.get("m").params[k].grad)


def test_a_forward_only_call_leaves_no_gradient(tiny_folder: str) -> None:
    t = _trainer(tiny_folder, {"m": 4})
    call = _call("m", "cross_entropy", 3)
    call.forward_only = True

    (outs, metrics), = t.forward_backward([call])

    assert all(p.grad is None for p in t.get("m").params.values())
    assert metrics["loss:sum"] > 0 and len(outs) == 2


def test_state_round_trip_continues_training_identically(tiny_folder: str) -> None:
    from miles_core.tinker.trainer import TinkerTrainer

    t = TinkerTrainer({"tiny": tiny_folder})
    t.create("m", "tiny", 4, seed=0)
    t.create("copy", "tiny", 4, seed=1)
    t.forward_backward([_call("m", "cross_entropy", 4)])
    t.optim_step("m", {"learning_rate": 1e-2})
    t.load_state("copy", t.state_bytes("m"), with_optimizer=True)
    for model_id in ("m", "copy"):
        t.forward_backward([_call(model_id, "cross_entropy", 5)])
        t.optim_step(model_id, {"learning_rate": 1e-2})

    for k, p in t.get("m").params.items():
        torch.testing.assert_close(p, t.get("copy").params[k], rtol=1e-5, atol=1e-7)
    assert t.get("copy").steps == 2


def test_a_state_of_another_rank_is_refused(tiny_folder: str) -> None:
    t = _trainer(tiny_folder, {"m": 4, "other": 8})
    with pytest.raises(ValueError, match="rank 4.*does not fit training client other \\(rank 8"):
        t.load_state("other", t.state_bytes("m"), with_optimizer=False)


def test_a_non_finite_gradient_is_not_stepped(tiny_folder: str) -> None:
    t = _trainer(tiny_folder, {"m": 4})
    t.forward_backward([_call("m", "cross_entropy", 6)])
    next(iter(t.get("m").params.values())).grad.fill_(float("nan"))
    before = {k: p.detach().clone() for k, p in t.get("m").params.items()}

    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        t.optim_step("m", {"learning_rate": 1e-2})

    for k, p in t.get("m").params.items():
        assert torch.equal(p, before[k])


# ------------------------------------------------------------------------------------- call order


def _queue(seq_wait_s: float = 60.0):
    from miles_core.tinker.calls import CallQueue

    failed: dict[str, str] = {}
    return CallQueue(lambda rid, e: failed.__setitem__(rid, str(e)), seq_wait_s, gather_s=0), failed


def _c(model_id: str, seq: int, kind: str = "optim_step"):
    from miles_core.tinker.calls import Call

    return Call(kind, model_id, seq, f"{model_id}-{seq}", None)


def test_calls_run_in_seq_id_order_whatever_order_they_arrive_in() -> None:
    q, failed = _queue()
    q.put(_c("m", 0, "create"), ordered=False)
    for seq in (3, 1, 2):
        q.put(_c("m", seq))
    q.put(_c("other", 7))

    rounds = []
    while ready := q._ready():
        rounds.append(sorted(c.request_id for c in ready))
        for c in ready:
            q.done(c)

    assert rounds == [["m-0", "other-7"], ["m-1"], ["m-2"], ["m-3"]]  # one call per client a round
    assert not failed


def test_a_call_below_one_that_ran_is_refused() -> None:
    q, failed = _queue()
    q.put(_c("m", 1))
    q.done(q._ready()[0])
    q.put(_c("m", 1))
    assert "seq_id 1 came after seq_id 1 had run" in failed["m-1"]


def test_a_gap_that_never_fills_fails_the_calls_behind_it_by_name() -> None:
    q, failed = _queue(seq_wait_s=0.0)
    q.put(_c("m", 1))
    q.done(q._ready()[0])
    q.put(_c("m", 3))  # seq_id 2 never comes

    assert q._ready() == []
    assert "waited 0 s for seq_id 2, which never came; seq_id 3 cannot run before it" in failed["m-3"]


def _gathering_queue(monkeypatch):
    """A queue whose rounds wait up to 30 s for clients on their way (a client stays active for 10
    minutes, however slow the machine), and an event set once ``take`` waits for one (a test that
    puts a call after it knows the call was waited for)."""
    import threading

    from miles_core.tinker import calls
    from miles_core.tinker.calls import CallQueue

    monkeypatch.setattr(calls, "ACTIVE_S", 600.0)

    q = CallQueue(lambda rid, e: None, gather_s=30.0)
    waiting = threading.Event()

    class Cond(type(q._cond)):
        def wait(self, timeout=None):
            waiting.set()
            return super().wait(timeout)

    q._cond = Cond()
    return q, waiting


def _take_in_thread(q):
    import threading

    out: list = []
    t = threading.Thread(target=lambda: out.append(q.take()), daemon=True)
    t.start()
    return t, out


def test_a_pass_waits_for_the_other_clients_and_runs_fused_with_theirs(monkeypatch) -> None:
    q, waiting = _gathering_queue(monkeypatch)
    for m in ("a", "b"):
        q.put(_c(m, 0, "create"), ordered=False)
    for c in q.take():
        q.done(c)  # both answered now
    q.put(_c("a", 1, "forward_backward"))

    t, out = _take_in_thread(q)
    assert waiting.wait(10), "take ran a's pass without waiting for b's"
    q.put(_c("b", 1, "forward_backward"))
    t.join(10)
    assert sorted(c.request_id for c in out[0]) == ["a-1", "b-1"]


def test_a_client_alone_never_waits_nor_for_idle_or_forgotten_ones(monkeypatch) -> None:
    from miles_core.tinker import calls

    q, waiting = _gathering_queue(monkeypatch)
    q.put(_c("a", 0, "create"), ordered=False)
    q.done(q.take()[0])
    q.put(_c("a", 1, "forward_backward"))
    ran = q.take()
    assert [c.request_id for c in ran] == ["a-1"]  # no other client: at once (else 30 s)
    q.done(ran[0])

    q.put(_c("b", 0, "create"), ordered=False)
    q.done(q.take()[0])
    q.forget("b")
    q.put(_c("a", 2, "forward_backward"))
    ran = q.take()
    assert [c.request_id for c in ran] == ["a-2"]
    q.done(ran[0])

    q.put(_c("c", 0, "create"), ordered=False)
    q.done(q.take()[0])
    q._answered["c"] -= 2 * calls.ACTIVE_S  # c was last answered long ago: idle (sampling, say)
    q.put(_c("a", 3, "forward_backward"))
    assert [c.request_id for c in q.take()] == ["a-3"]
    assert not waiting.is_set()


def test_take_returns_none_once_closed() -> None:
    q, _ = _queue()
    q.close()
    assert q.take() is None


# -------------------------------------------------------------------------------------- sampling


def test_engine_keeps_at_most_its_cap_of_snapshots_and_reloads_an_evicted_one(tiny_folder: str, tmp_path) -> None:
    import asyncio

    from tinker.proto import response_conv

    from miles_core.config import HFEngineConfig
    from miles_core.engines.hf import HFEngine
    from miles_core.tinker.futures import Futures
    from miles_core.tinker.sampling import Sampler, Samplers, adapter_name

    t = _trainer(tiny_folder, {"a": 4, "b": 4, "c": 4})
    folders = {}
    for model_id in ("a", "b", "c"):
        t.forward_backward([_call(model_id, "cross_entropy", 7)])
        t.optim_step(model_id, {"learning_rate": 5e-2})
        folders[model_id] = str(tmp_path / model_id)
        t.save_sampler(model_id, folders[model_id])

    async def main() -> list[list[int]]:
        engine = HFEngine(tiny_folder, HFEngineConfig())
        engine.share_weights(t.banks["tiny"].model)
        sampling = Samplers({"tiny": engine}, Futures(asyncio.get_running_loop()), engine_adapters=2)
        for model_id, folder in folders.items():
            sampling.add(model_id, Sampler("tiny", adapter_name(folder), folder))
        body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 74, 5, 6, 82]}]},
                "sampling_params": {"max_tokens": 3, "temperature": 0.0}}
        out = []
        for model_id in ("a", "b", "c", "a"):  # "a" is evicted by "c", then comes back from its folder
            request_id, _ = sampling.sample({**body, "sampling_session_id": model_id})
            result = await sampling.futures.wait(request_id)
            out.append(response_conv.deserialize_sample_response(result.body).sequences[0].tokens)
            assert len(engine.adapters) <= 2
        await engine.close()
        return out

    a, _, _, a_again = asyncio.run(main())
    assert a == a_again


def test_engine_options_make_the_engine_config_and_bad_ones_are_named() -> None:
    from miles_core.config import HFEngineConfig, SGLangEngineConfig, VLLMEngineConfig
    from miles_core.tinker.server import engine_config

    assert engine_config("hf", []) == HFEngineConfig()
    vllm = engine_config("vllm", ["url=http://10.0.0.5:8000", "cpu_affinity=[1]"])
    assert isinstance(vllm, VLLMEngineConfig) and (vllm.url, vllm.cpu_affinity) == ("http://10.0.0.5:8000", [1])
    assert vllm.max_lora_rank == 64  # the SDK's default rank (32) fits without an option
    assert engine_config("vllm", ["max_lora_rank=16"]).max_lora_rank == 16
    assert isinstance(engine_config("sglang", ["url=http://h:30000"]), SGLangEngineConfig)
    with pytest.raises(SystemExit, match="give KEY=VALUE"):
        engine_config("vllm", ["cpu_affinity"])
    with pytest.raises(SystemExit, match="max_lora_rnak"):  # a misspelt field is refused, not ignored
        engine_config("vllm", ["max_lora_rnak=32"])
    with pytest.raises(SystemExit, match="must start with http"):
        engine_config("sglang", ["url=10.0.0.5:30000"])


def test_results_are_forgotten_after_keep_s_and_pending_ones_never() -> None:
    import asyncio

    from miles_core.tinker.futures import Futures, Result

    async def check(keep_s: float):
        futures = Futures(asyncio.get_running_loop(), poll_s=0.0, keep_s=keep_s)
        done, waiting = futures.new("sample"), futures.new("sample")
        futures.resolve(done, Result(b"{}"))
        futures.new("sample")  # forgetting happens as new requests come
        try:
            result = (await futures.wait(done)).body
        except KeyError:
            result = "forgotten"
        return result, await futures.wait(waiting)  # still pending: None (try again), never forgotten

    assert asyncio.run(check(3600.0)) == (b"{}", None)
    assert asyncio.run(check(-1.0)) == ("forgotten", None)
