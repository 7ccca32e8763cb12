"""Draft and target vocabularies: which pairs may run together, and which ids the draft may
propose (runtime.speculation.vocab.DraftVocab).

Equal vocab_size: accepted as always, nothing is restricted. Different vocab_size (an
embedding padded differently, as Qwen2.5-0.5B's 151,936 rows beside Qwen2.5-7B's 152,064)
is accepted when both speak one tokenizer, decided from tokenizer files:
- the tokenizer in use is `tokenizer` when configured, else the target checkpoint's own;
- when the draft checkpoint has a tokenizer too, it must load to the same vocabulary as the
  one in use (the same size and the same token -> id map), else the draft speaks another
  tokenizer: refused (cross-tokenizer drafting is not supported);
- with no tokenizer at all (neither configured nor beside either model) nothing shows that
  the ids mean the same: refused, naming both sizes (configure `tokenizer` to vouch);
- the tokenizer's size (len(tokenizer): its vocabulary and added tokens) must fit in both
  embeddings; the draft then proposes only ids below it.
"""
from __future__ import annotations

from runtime.config.schema import TandemConfig
from runtime.errors import ConfigError

__all__ = ["check_vocab", "propose_limit"]


def check_vocab(cfg: TandemConfig, draft_vocab: int, target_vocab: int) -> int | None:
    """The config check: None for equal sizes, else the number of ids the draft may propose
    (the shared tokenizer's size). Raises ConfigError naming the key."""
    if draft_vocab == target_vocab:
        return None
    key, tokenizer = _tokenizer_in_use(cfg)
    draft_tok = _load(cfg.draft.model, "draft.model")
    if tokenizer is not None and draft_tok is not None and not _same(tokenizer, draft_tok):
        raise ConfigError("draft.model", f"the draft {cfg.draft.model} has a different "
                          f"tokenizer from the target's ({_where(cfg)}): "
                          f"{len(draft_tok)} tokens against {len(tokenizer)}, or the same "
                          f"tokens with other ids; draft and target must share one "
                          f"tokenizer (drafting across tokenizers is not supported)")
    tokenizer = tokenizer if tokenizer is not None else draft_tok
    if tokenizer is None:
        raise ConfigError("draft.model", f"vocab mismatch: draft {cfg.draft.model} has "
                          f"vocab_size {draft_vocab} but target {cfg.target.model} has "
                          f"vocab_size {target_vocab}, and no tokenizer shows that they "
                          f"share one (neither checkpoint has tokenizer files); set "
                          f"`tokenizer` to the one both use, or use a draft of vocab_size "
                          f"{target_vocab}")
    return _fits(len(tokenizer), key or "draft.model", draft_vocab, target_vocab)


def propose_limit(cfg: TandemConfig, draft_vocab: int, target_vocab: int) -> int | None:
    """What check_vocab returns, for a worker (the config passed that check already): the
    size of the tokenizer in use, or of the draft's where none is; None for equal sizes."""
    if draft_vocab == target_vocab:
        return None
    _, tokenizer = _tokenizer_in_use(cfg)
    if tokenizer is None:
        tokenizer = _load(cfg.draft.model, "draft.model")
    if tokenizer is None:   # load_config(check_files=False) let it through: be safe
        return min(draft_vocab, target_vocab)
    return min(len(tokenizer), draft_vocab, target_vocab)


def _tokenizer_in_use(cfg: TandemConfig):
    """(its config key or None for the target's own, the tokenizer or None)."""
    if cfg.tokenizer is not None:
        return "tokenizer", _load(cfg.tokenizer, "tokenizer", required=True)
    return None, _load(cfg.target.model, "target.model")


def _load(path: str, key: str, required: bool = False):
    from runtime.models.loading.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path, required=required)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"cannot load the tokenizer of {path}: {exc}") from None


def _same(a, b) -> bool:
    """One vocabulary: the same size and the same token -> id map (added tokens included)."""
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()


def _where(cfg: TandemConfig) -> str:
    return f"`tokenizer` {cfg.tokenizer}" if cfg.tokenizer is not None else cfg.target.model


def _fits(size: int, key: str, draft_vocab: int, target_vocab: int) -> int:
    smaller = min(draft_vocab, target_vocab)
    if size > smaller:
        which = "draft" if draft_vocab < target_vocab else "target"
        raise ConfigError(key, f"the tokenizer has {size} tokens but the {which}'s "
                          f"embedding only {smaller} rows (draft vocab_size {draft_vocab}, "
                          f"target vocab_size {target_vocab}); both must cover the "
                          f"tokenizer")
    return size
