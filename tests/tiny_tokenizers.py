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


def save_text_tokenizer(out_dir: str | os.PathLike, alphabet: str, words: bool) -> str:
    """Two tokenizers that split one text differently (drafting across tokenizers):
    words=True: word-level, "<unk>" (id 0) then every word of one or two letters of
    `alphabet`, split at spaces (decoded joined by spaces); words=False: character-level,
    " " (id 0), each letter, then "?" (the unknown), spaces kept as tokens."""
    import itertools

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if words:
        vocab = (
            ["<unk>"] + list(alphabet) + ["".join(p) for p in itertools.product(alphabet, repeat=2)]
        )
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:
        vocab = [" "] + list(alphabet) + ["?"]
        tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(vocab)}, unk_token="?"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=vocab[0] if words else vocab[-1])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return str(out)
