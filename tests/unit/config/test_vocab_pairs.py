"""runtime.config.vocab: draft/target vocab_size may differ over one tokenizer (embeddings
padded differently); none to tell is refused naming the key; a draft with a different
tokenizer drafts across tokenizers, which needs `acceptance: tokens`."""

from __future__ import annotations

import pytest

from runtime.config import load_config
from runtime.config.vocab import check_vocab, cross_tokenizer, propose_limit
from runtime.errors import ConfigError
from tests.checkpoints import build_checkpoint
from tests.tiny_tokenizers import save_tokenizer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Tokenizer dirs standing for checkpoints (check_vocab reads only tokenizer files)."""
    root = tmp_path_factory.mktemp("vocab")
    (root / "bare").mkdir()
    return {
        "tok90": save_tokenizer(root / "tok90", 90),
        "tok90b": save_tokenizer(root / "tok90b", 90),
        "shifted": save_tokenizer(root / "shifted", 90, shift=1),
        "tok100": save_tokenizer(root / "tok100", 100),
        "bare": str(root / "bare"),
    }


def cfg(draft: str, target: str, tokenizer: str | None = None, acceptance: str = "tokens"):
    raw = {
        "draft": {"model": draft, "devices": ["cpu:0"]},
        "target": {"model": target, "devices": ["cpu:1"]},
        "speculation": {"acceptance": acceptance},
    }
    if tokenizer is not None:
        raw["tokenizer"] = tokenizer
    return load_config(raw, check_files=False, check_devices=False)


def refused(config, draft_vocab, target_vocab, key, *words) -> str:
    with pytest.raises(ConfigError) as info:
        check_vocab(config, draft_vocab, target_vocab)
    text = str(info.value)
    assert text.startswith(f"{key}:") and all(w in text for w in words), text
    return text


def test_equal_sizes_need_no_tokenizer(dirs):
    assert check_vocab(cfg(dirs["bare"], dirs["bare"]), 96, 96) is None
    assert propose_limit(cfg(dirs["bare"], dirs["bare"]), 96, 96) is None


@pytest.mark.parametrize("draft_vocab,target_vocab", [(112, 96), (90, 96), (96, 90)])
def test_same_tokenizer_padded_differently(dirs, draft_vocab, target_vocab):
    config = cfg(dirs["tok90"], dirs["tok90b"])
    assert check_vocab(config, draft_vocab, target_vocab) == 90
    assert propose_limit(config, draft_vocab, target_vocab) == 90


def test_one_tokenizer_present_is_the_one(dirs):
    assert check_vocab(cfg(dirs["bare"], dirs["tok90"]), 112, 96) == 90  # the target's
    assert check_vocab(cfg(dirs["tok90"], dirs["bare"]), 112, 96) == 90  # the draft's
    assert propose_limit(cfg(dirs["tok90"], dirs["bare"]), 112, 96) == 90
    configured = cfg(dirs["bare"], dirs["bare"], tokenizer=dirs["tok90"])
    assert check_vocab(configured, 112, 96) == 90


@pytest.mark.parametrize("draft_vocab", [112, 96])
def test_different_tokenizer_drafts_across(dirs, draft_vocab):
    """Another size, or the same tokens with other ids, whatever the embeddings' sizes:
    accepted under `tokens` (nothing restricted), refused under `logits`."""
    for draft in ("shifted", "tok100"):
        config = cfg(dirs[draft], dirs["tok90"])
        assert cross_tokenizer(config)
        assert check_vocab(config, draft_vocab, 96) is None
        assert propose_limit(config, draft_vocab, 96) is None
        refused(
            cfg(dirs[draft], dirs["tok90"], acceptance="logits"),
            draft_vocab,
            96,
            "speculation.acceptance",
            "different tokenizer",
            "acceptance: tokens",
        )
    configured = cfg(dirs["shifted"], dirs["tok90"], tokenizer=dirs["tok90b"], acceptance="logits")
    refused(configured, draft_vocab, 96, "speculation.acceptance", "`tokenizer`")
    assert not cross_tokenizer(cfg(dirs["tok90b"], dirs["tok90"]))
    assert not cross_tokenizer(cfg(dirs["bare"], dirs["tok90"]))


def test_no_tokenizer_refused_naming_both_sizes(dirs):
    refused(
        cfg(dirs["bare"], dirs["bare"]),
        112,
        96,
        "draft.model",
        "vocab_size 112",
        "vocab_size 96",
        "tokenizer",
    )


def test_tokenizer_must_fit_both_embeddings(dirs):
    refused(cfg(dirs["tok100"], dirs["tok100"]), 112, 96, "draft.model", "100", "96")
    refused(
        cfg(dirs["bare"], dirs["bare"], tokenizer=dirs["tok100"]),
        96,
        112,
        "tokenizer",
        "draft's embedding",
    )


def test_load_config_accepts_a_padded_pair(tmp_path):
    """The whole config check, on checkpoints: target vocab 96, draft 112, one tokenizer."""
    target = build_checkpoint(tmp_path / "target", vocab_size=96)
    draft = build_checkpoint(tmp_path / "draft", vocab_size=112, seed=1)
    raw = {
        "draft": {"model": draft, "devices": ["cpu:0"]},
        "target": {"model": target, "devices": ["cpu:1"]},
    }
    with pytest.raises(ConfigError, match="draft.model: vocab mismatch"):
        load_config(raw)
    save_tokenizer(target, 90)
    assert load_config(raw).draft.model == draft
    save_tokenizer(draft, 90, shift=3)  # another tokenizer: tokens only
    assert load_config(raw).draft.model == draft
    with pytest.raises(ConfigError, match="speculation.acceptance: .*different tokenizer"):
        load_config({**raw, "speculation": {"acceptance": "logits"}})
