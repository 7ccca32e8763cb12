"""Draft and target vocabularies: which pairs may run together, and which ids the draft may
propose (runtime.speculation.vocab.DraftVocab).

A draft whose checkpoint has a tokenizer other than the one in use (another size, or the
same tokens with other ids) drafts across tokenizers (`cross_tokenizer`): its proposals
cross as text (runtime.speculation.retokenize, runtime.serving.cross_round), which needs
`acceptance: tokens`; `logits` is refused naming speculation.acceptance (the draft's q is a
distribution over other ids). Its embedding may then have any size.

Equal vocab_size: accepted as always, nothing is restricted. Different vocab_size (an
embedding padded differently, as Qwen2.5-0.5B's 151,936 rows beside Qwen2.5-7B's 152,064)
is accepted when both speak one tokenizer, decided from tokenizer files:
- the tokenizer in use is `tokenizer` when configured, else the target checkpoint's own;
- when the draft checkpoint has a tokenizer too, it must load to the same vocabulary as the
  one in use (the same size and the same token -> id map), else the draft speaks another
  tokenizer: drafting across tokenizers (above);
- with no tokenizer at all (neither configured nor beside either model) nothing shows that
  the ids mean the same: refused, naming both sizes (configure `tokenizer` to vouch);
- the tokenizer's size (len(tokenizer): its vocabulary and added tokens) must fit in both
  embeddings; the draft then proposes only ids below it.
"""

from __future__ import annotations

import os

from runtime.config.schema import TandemConfig
from runtime.errors import ConfigError

__all__ = ["check_vocab", "cross_tokenizer", "propose_limit"]


def check_vocab(cfg: TandemConfig, draft_vocab: int, target_vocab: int) -> int | None:
    """The config check: None for equal sizes or a draft with its own tokenizer, else the
    number of ids the draft may propose (the shared tokenizer's size). Raises ConfigError
    naming the key."""
    if cross_tokenizer(cfg):
        if cfg.speculation.acceptance != "tokens":
            raise ConfigError(
                "speculation.acceptance",
                f"the draft {cfg.draft.model} has a "
                f"different tokenizer from the target's ({_where(cfg)}): "
                f"drafting across tokenizers needs `acceptance: tokens`, not "
                f"{cfg.speculation.acceptance!r}",
            )
        return None
    if draft_vocab == target_vocab:
        return None
    key, tokenizer = _tokenizer_in_use(cfg)
    tokenizer = tokenizer if tokenizer is not None else _load(cfg.draft.model, "draft.model")
    if tokenizer is None:
        raise ConfigError(
            "draft.model",
            f"vocab mismatch: draft {cfg.draft.model} has "
            f"vocab_size {draft_vocab} but target {cfg.target.model} has "
            f"vocab_size {target_vocab}, and no tokenizer shows that they "
            f"share one (neither checkpoint has tokenizer files); set "
            f"`tokenizer` to the one both use, or use a draft of vocab_size "
            f"{target_vocab}",
        )
    return _fits(len(tokenizer), key or "draft.model", draft_vocab, target_vocab)


def cross_tokenizer(cfg: TandemConfig) -> bool:
    """Whether the draft speaks another tokenizer than the one in use: its checkpoint has
    one, and it differs (a draft that is the target's own checkpoint never does)."""
    tokenizer = cfg.tokenizer if cfg.tokenizer is not None else cfg.target.model
    return _differ(cfg.draft.model, tokenizer, cfg.tokenizer is not None)


def _differ(draft: str, tokenizer: str, configured: bool) -> bool:
    """(paths not on disk, e.g. ids not resolved by load_config(check_files=False): no)"""
    if draft == tokenizer or not (os.path.exists(draft) and os.path.exists(tokenizer)):
        return False
    if _same_file(draft, tokenizer, "tokenizer.json"):
        return False
    draft_tok = _load(draft, "draft.model")
    if draft_tok is None:
        return False
    used = _load(tokenizer, "tokenizer" if configured else "target.model", configured)
    return used is not None and not _same(used, draft_tok)


def _same_file(a: str, b: str, name: str) -> bool:
    """Whether both dirs hold the file `name` with the same bytes (no tokenizer loaded)."""
    paths = [os.path.join(d, name) for d in (a, b)]
    if not all(os.path.isfile(p) for p in paths):
        return False
    with open(paths[0], "rb") as fa, open(paths[1], "rb") as fb:
        return fa.read() == fb.read()


def propose_limit(cfg: TandemConfig, draft_vocab: int, target_vocab: int) -> int | None:
    """What check_vocab returns, for a worker (the config passed that check already): the
    size of the tokenizer in use, or of the draft's where none is; None for equal sizes."""
    if draft_vocab == target_vocab or cross_tokenizer(cfg):
        return None
    _, tokenizer = _tokenizer_in_use(cfg)
    if tokenizer is None:
        tokenizer = _load(cfg.draft.model, "draft.model")
    if tokenizer is None:  # load_config(check_files=False) let it through: be safe
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
        raise ConfigError(
            key,
            f"the tokenizer has {size} tokens but the {which}'s "
            f"embedding only {smaller} rows (draft vocab_size {draft_vocab}, "
            f"target vocab_size {target_vocab}); both must cover the "
            f"tokenizer",
        )
    return size
