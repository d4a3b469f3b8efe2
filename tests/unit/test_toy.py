"""The toy addition task (splits, reward, warm-start corpus) and the built-in tiny model's cache."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from miles_core.config import ModelConfig, TinyModelRecipe, ToyDataConfig
from miles_core.data.toy import carry_free_sum, toy_problems, toy_reward, toy_split

# ------------------------------------------------------------------------------------- the task


def _pairs(rows):
    return {tuple(map(int, r["prompt"].removesuffix("=").split("+"))) for r in rows}


def _pool(cfg: ToyDataConfig, split):
    """The whole pool of a split (train's default count is ``num_prompts``)."""
    m = cfg.max_operand + 1
    size = sum(toy_split(a, b) == split for a in range(m) for b in range(m))
    return toy_problems(cfg, split, size)


def test_splits_partition_all_pairs():
    cfg = ToyDataConfig()
    train, test, sft = (_pairs(_pool(cfg, s)) for s in ("train", "test", "sft"))
    assert not train & test and not train & sft and not test & sft
    assert train | test | sft == {(a, b) for a in range(100) for b in range(100)}
    assert len(test) >= 512
    assert len(train) >= cfg.num_prompts


def test_rows_are_well_formed():
    for row in toy_problems(ToyDataConfig(), "test", 50):
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        assert row == {"prompt": f"{a}+{b}=", "label": str(a + b)}


def test_splits_are_deterministic_and_seed_only_reorders():
    cfg = ToyDataConfig(num_prompts=300)
    assert toy_problems(cfg, "train") == toy_problems(cfg, "train")
    assert toy_problems(cfg, "sft", 100) == toy_problems(cfg, "sft", 100)
    other_seed = ToyDataConfig(num_prompts=300, seed=2)
    assert toy_problems(other_seed, "train") != toy_problems(cfg, "train")
    # The held-out set is the same for every seed, so "the first N" compares across runs.
    assert toy_problems(other_seed, "test") == toy_problems(cfg, "test")
    assert len(toy_problems(cfg, "train")) == 300


def test_split_of_a_pair_does_not_depend_on_operand_range():
    small, big = ToyDataConfig(max_operand=20), ToyDataConfig(max_operand=99)
    assert _pairs(_pool(small, "test")) <= _pairs(_pool(big, "test"))
    assert not _pairs(_pool(small, "test")) & _pairs(_pool(big, "sft"))
    assert not _pairs(_pool(small, "sft")) & _pairs(_pool(big, "test"))


def test_too_many_problems_is_a_clear_error():
    with pytest.raises(ValueError, match="max_operand=9 gives only"):
        toy_problems(ToyDataConfig(max_operand=9), "train")  # 4096 asked, ~60 exist
    with pytest.raises(ValueError, match="split must be"):
        toy_problems(ToyDataConfig(), "valid")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("82", "82", 1.0),
        (" 82\n", "82", 1.0),  # surrounding whitespace is stripped
        ("082", "82", 0.0),  # no numeric normalisation
        ("8", "82", 0.0),
        ("82 82", "82", 0.0),
        ("", "0", 0.0),
        ("0", "0", 1.0),
    ],
)
def test_reward_is_exact_match(response, label, reward):
    assert toy_reward(response, label) == reward


def test_carry_free_sum():
    assert carry_free_sum(37, 45) == 72  # 7+5=12 -> 2, 3+4 -> 7
    assert carry_free_sum(98, 45) == 33  # 8+5=13 -> 3, 9+4=13 -> 3, hundreds lost
    assert carry_free_sum(12, 34) == 46  # no carry: the true sum
    assert carry_free_sum(5, 0) == 5


def test_sft_corpus_comes_from_the_sft_split():
    from miles_core.models.tiny import sft_rows

    rows = sft_rows(TinyModelRecipe(sft_examples=400))
    assert len(rows) == 400 and rows == sft_rows(TinyModelRecipe(sft_examples=400))
    assert all(toy_split(a, b) == "sft" for a, b in _pairs(rows))
    for row in rows:
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        assert row["label"] == str(a + b) and row["carry_free_label"] == str(carry_free_sum(a, b))


def test_carry_free_labels_are_drawn_per_occurrence():
    import torch

    from miles_core.models.tiny import pick_carry_free

    has_carry = torch.tensor([True, False, True, True])  # 4 problems; rows 4..7 are their carry-free twins
    batch = torch.tensor([0, 1, 2, 3] * 2500)
    picked = pick_carry_free(batch, has_carry, 0.8, torch.Generator().manual_seed(0))
    assert ((picked == batch) | (picked == batch + 4)).all()
    assert (picked[batch == 1] == 1).all()  # a problem without a carry keeps its (true) label
    assert 0.77 < (picked[batch == 0] == 4).float().mean() < 0.83  # share 0.8 of draws mislabelled
    assert (pick_carry_free(batch, has_carry, 0.0, torch.Generator()) == batch).all()


# ------------------------------------------------------------------------------ greedy accuracy


class _ScriptedModel:
    """Stands in for a causal LM: ``generate`` appends a scripted response to each prompt."""

    def __init__(self, tokenizer, responses: dict[str, str]):
        self.tokenizer, self.responses = tokenizer, responses

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **_):
        import torch

        assert (attention_mask[:, -1] == 1).all(), "prompts must be left-padded"
        outs = []
        for ids in input_ids:
            prompt = self.tokenizer.decode(ids, skip_special_tokens=True)
            new = self.tokenizer(self.responses[prompt], add_special_tokens=False)["input_ids"] + [eos_token_id]
            outs.append(new[:max_new_tokens])
        width = max(map(len, outs))
        outs = [o + [pad_token_id] * (width - len(o)) for o in outs]
        return torch.cat([input_ids, torch.tensor(outs)], dim=1)


def test_greedy_accuracy_scores_the_new_tokens_only():
    from miles_core.models.tiny import build_tokenizer, greedy_accuracy

    tokenizer = build_tokenizer()
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "37+45=", "label": "82"}, {"prompt": "9+9=", "label": "18"}]
    model = _ScriptedModel(tokenizer, {"1+2=": "3", "37+45=": "72", "9+9=": "18"})
    assert greedy_accuracy(model, tokenizer, rows, batch_size=2) == pytest.approx(2 / 3)
    # Truncated responses (no room for the whole answer) are wrong.
    assert greedy_accuracy(model, tokenizer, rows, max_new_tokens=1) == pytest.approx(1 / 3)


# ---------------------------------------------------------------------------------- the cache

TINY = TinyModelRecipe(
    hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, sft_steps=3, sft_mistake_steps=2, sft_batch_size=8,
    sft_examples=16, max_operand=9,
)


def _ensure(cfg: ModelConfig) -> tuple[Path, list[str]]:
    from miles_core.models import ensure_model

    logs: list[str] = []
    return ensure_model(cfg, log=logs.append), logs


def _built(logs: list[str]) -> bool:
    return any("building" in line for line in logs)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One tiny built-in model in a fresh cache: (config, folder, build logs)."""
    import torch

    torch.set_num_threads(1)
    cfg = ModelConfig(tiny=TINY, cache_dir=str(tmp_path_factory.mktemp("cache")))
    path, logs = _ensure(cfg)
    return cfg, path, logs


def test_build_writes_a_complete_model(built):
    from miles_core.models.tiny import recipe_hash

    cfg, path, logs = built
    assert _built(logs)
    assert any("warm start (addition): step 3/3 loss" in line for line in logs)
    assert any("warm start (carry-free mistake): step 2/2 loss" in line for line in logs)
    assert path == Path(cfg.cache_dir) / f"tiny-addition-{recipe_hash(TINY)}"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "warm_start.json", "_COMPLETE"):
        assert (path / name).is_file(), name
    report = json.loads((path / "warm_start.json").read_text())
    assert report["recipe"] == TINY.model_dump(mode="json")
    assert report["sft_examples"] == 16
    assert 0.0 <= report["held_out_greedy_accuracy"] <= 1.0
    assert report["held_out_problems"] == len(toy_problems(ToyDataConfig(max_operand=9), "test"))
    assert [p.name for p in Path(cfg.cache_dir).iterdir() if p.is_dir()] == [path.name]  # no temp folders left


def test_second_call_reuses_the_cache(built):
    cfg, path, _ = built
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    again, logs = _ensure(cfg)
    assert again == path and not _built(logs)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_warm_start_changes_every_parameter(built, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles_core.models.tiny import build_untrained

    _, path, _ = built
    untrained = AutoModelForCausalLM.from_pretrained(build_untrained(TINY, tmp_path))  # same seed: same init
    trained = AutoModelForCausalLM.from_pretrained(path)
    before = dict(untrained.named_parameters())
    for name, param in trained.named_parameters():
        assert not param.detach().equal(before[name].detach()), f"{name} did not change"


def test_other_recipe_or_code_version_gets_another_folder(built, monkeypatch):
    from miles_core.models import tiny

    cfg, path, _ = built
    assert tiny.recipe_hash(TINY.model_copy(update={"sft_steps": 4})) != tiny.recipe_hash(TINY)
    monkeypatch.setattr(tiny, "RECIPE_CODE_VERSION", tiny.RECIPE_CODE_VERSION + 1)
    assert tiny.recipe_hash(TINY) != path.name.removeprefix("tiny-addition-")


def test_incomplete_folder_is_rebuilt(tmp_path):
    cfg = ModelConfig(tiny=TINY.model_copy(update={"seed": 1}), cache_dir=str(tmp_path))
    path, _ = _ensure(cfg)
    (path / "_COMPLETE").unlink()  # as if a build had died before its marker
    (path / "junk.bin").write_bytes(b"partial")
    again, logs = _ensure(cfg)
    assert again == path and _built(logs)
    assert (path / "_COMPLETE").is_file() and not (path / "junk.bin").exists()


def test_concurrent_callers_build_once(tmp_path):
    cfg = ModelConfig(tiny=TINY.model_copy(update={"seed": 2}), cache_dir=str(tmp_path))
    results: list[tuple[Path, list[str]]] = []
    threads = [threading.Thread(target=lambda: results.append(_ensure(cfg))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0][0] == results[1][0]
    assert sum(_built(logs) for _, logs in results) == 1
    assert (results[0][0] / "_COMPLETE").is_file()


def test_local_folder_is_checked(tmp_path, tiny_model_dir):
    assert _ensure(ModelConfig(path=str(tiny_model_dir)))[0] == Path(tiny_model_dir)
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"{missing}.*does not exist.*tiny-addition, smollm2-135m-instruct"):
        _ensure(ModelConfig(path=str(missing)))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        _ensure(ModelConfig(path=str(tmp_path)))
    for unknown in ("builtin:tiny-multiply", "smollm3-3b"):  # a name no built-in model has, listing the ones there are
        with pytest.raises(ValueError, match=f"{unknown!r} is neither a built-in model "
                                             r"\(tiny-addition, smollm2-135m-instruct\) nor a local folder"):
            _ensure(ModelConfig(path=unknown))


def test_the_tiny_model_is_named_with_or_without_builtin(built):
    cfg, folder, _ = built
    assert _ensure(cfg.model_copy(update={"path": "tiny-addition"}))[0] == folder


def test_task_and_cache_modules_import_without_torch():
    import subprocess
    import sys

    code = "import sys, miles_core.data.toy, miles_core.models; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_fresh_cache_takes_the_shipped_build_of_the_default_recipe(tmp_path):
    """The default recipe's build ships with the package: a fresh clone copies it instead of a ~2 min
    build, and the copy is the shipped weights byte for byte."""
    from miles_core.models.tiny import SHIPPED, recipe_hash

    name = f"tiny-addition-{recipe_hash(TinyModelRecipe())}"
    assert [p.name for p in SHIPPED.iterdir() if p.is_dir()] == [name], (
        "the shipped build is not the default recipe's: rebuild it (`miles build-model --no-shipped`) and copy the "
        "folder, without _COMPLETE, to miles_core/models/shipped/")
    path, logs = _ensure(ModelConfig(cache_dir=str(tmp_path)))
    assert path == tmp_path / name and not _built(logs) and any("shipped build" in line for line in logs)
    assert (path / "model.safetensors").read_bytes() == (SHIPPED / name / "model.safetensors").read_bytes()
    assert (path / "_COMPLETE").read_text().strip() == recipe_hash(TinyModelRecipe())
    report = json.loads((path / "warm_start.json").read_text())
    assert report["recipe"] == TinyModelRecipe().model_dump(mode="json")
