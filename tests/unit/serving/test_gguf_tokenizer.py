"""The tokenizer of a .gguf file: converted once into the GGUF cache
(runtime.models.loading.gguf_cache), then read from there, and the same tokenizer either way."""

from __future__ import annotations

import pytest

from runtime.models.loading import disk_cache
from runtime.models.loading.tokenizer import load_tokenizer
from tests.checkpoints import smollm2_gguf, smollm2_tokenizer

pytestmark = pytest.mark.timeout(300)

TEXTS = [
    "The three primary colors are",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  spaces\n\ttabs ünïcödé 日本語 🙂 <|endoftext|> 1234567",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(read from the GGUF by transformers, first start: converted, second start: cached),
    with how often the second one parsed the GGUF."""
    from gguf import GGUFReader

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path_factory.mktemp("tok-cache")))
        first = load_tokenizer(smollm2_gguf())
        parses, init = [], GGUFReader.__init__

        def counting_init(reader, *args, **kwargs):
            parses.append(args)
            init(reader, *args, **kwargs)

        mp.setattr(GGUFReader, "__init__", counting_init)
        second = load_tokenizer(smollm2_gguf())
    return smollm2_tokenizer(), first, second, len(parses)


def test_the_second_start_does_not_parse_the_gguf(tokenizers):
    assert tokenizers[3] == 0


@pytest.mark.parametrize("which", [1, 2])
def test_the_cached_tokenizer_is_the_ggufs(tokenizers, which):
    want, got = tokenizers[0], tokenizers[which]
    assert got.is_fast
    assert got.get_vocab() == want.get_vocab()
    assert got.all_special_ids == want.all_special_ids
    assert (got.eos_token_id, got.bos_token_id, got.pad_token_id) == (
        want.eos_token_id,
        want.bos_token_id,
        want.pad_token_id,
    )
    for text in TEXTS:
        ids = want.encode(text)
        assert got.encode(text) == ids, text
        assert got.decode(ids) == want.decode(ids)
        assert got.decode(ids, skip_special_tokens=True) == want.decode(
            ids, skip_special_tokens=True
        )
    assert got.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    ) == want.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
