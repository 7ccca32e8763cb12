"""Tiny word-level tokenizers saved beside (or apart from) tiny checkpoints, for the tests of
drafts whose embedding is padded differently over one tokenizer (runtime.config.vocab).
Built with the `tokenizers` library: nothing is downloaded."""
from __future__ import annotations

import os
from pathlib import Path


def save_tokenizer(out_dir: str | os.PathLike, size: int, shift: int = 0) -> str:
    """A tokenizer of `size` tokens "w0".."w{size-1}" saved into out_dir (created if need
    be); token "w{(i + shift) % size}" has id i, so another shift is the same tokens with
    other ids (a different tokenizer of the same size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{(i + shift) % size}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return str(out)
