"""The built-in tiny model: a character-level tokenizer and a small Llama-config causal LM.

- ``build_tokenizer()``: printable-ASCII character tokenizer (``tokenizers`` WordLevel + Fuse
  decoder) wrapped as ``PreTrainedTokenizerFast``; ``<pad>`` is id 0, ``<eos>`` id 1.
- ``build_untrained(recipe, out_dir)``: a randomly initialised model saved with its tokenizer.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from miles_core.config import TinyModelRecipe

PAD, EOS = "<pad>", "<eos>"
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left", clean_up_tokenization_spaces=False
    )


def build_untrained(recipe: TinyModelRecipe, out_dir: str | Path) -> Path:
    """Save a randomly initialised tiny Llama model and its tokenizer to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
