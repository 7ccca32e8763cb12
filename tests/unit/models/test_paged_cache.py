"""The paged KV cache on the eager path (runtime/models/arch/cache.py): block tables other
than the fixed slot layout give the same logits bit for bit, rows whose blocks interleave
attend only their own, padding tokens write only the scratch block, block sizes that do not
divide the row length work, and the runners take tables as a static input. (The Triton
kernels over shuffled tables: tests/unit/models/test_kernels.py, test_attention_kernel.py.)"""

from __future__ import annotations

import pytest
import torch

from runtime.config.schema import RuntimeConfig
from runtime.errors import ConfigError
from runtime.models import load_model
from runtime.models.arch.cache import blocks_for, slot_block_table
from runtime.models.runners.kv_budget import cache_bytes
from runtime.models.runners.step_runner import StepRunner
from runtime.worker.block_tables import SlotTables

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
ROWS, CACHE_LEN = 4, 64


def fresh(path: str, block_size: int = 16):
    model = load_model(path, torch.float32, CPU)
    model.allocate_cache(ROWS, CACHE_LEN, block_size)
    return model


def identity(model, rows: list[int]) -> torch.Tensor:
    return torch.tensor(slot_block_table(rows, model.blocks_per_seq), dtype=torch.int32)


def shuffled(model, rows: int, seed: int = 0) -> torch.Tensor:
    """Tables [rows, M] of distinct blocks in a random order: rows interleave in the pool."""
    perm = torch.randperm(model.num_blocks, generator=torch.Generator().manual_seed(seed))
    return perm[: rows * model.blocks_per_seq].view(rows, -1).to(torch.int32)


STEPS = [  # (tokens a row, starts, valid lengths): a ragged prefill, a verify, a decode step
    (20, [0, 0, 0], [20, 7, 13]),
    (5, [20, 7, 13], [5, 3, 1]),
    (1, [25, 10, 14], [1, 1, 1]),
]


def run_steps(model, tables: torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
    """STEPS through model.forward_extend with these tables; the valid logits of each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for seq, starts, n_valid in STEPS:
        ids = torch.randint(3, 96, (len(starts), seq), generator=g)
        logits = model.forward_extend(ids, tables, torch.tensor(starts), torch.tensor(n_valid))
        ok = torch.arange(seq)[None, :] < torch.tensor(n_valid)[:, None]
        out.append(logits[ok])
    return out


@pytest.mark.parametrize("block_size", [16, 8, 5, 1])
def test_shuffled_tables_give_the_same_logits(llama_path, block_size):
    """Block size 5 does not divide the 64 positions of a row (13 blocks, 65 positions)."""
    plain, mixed = fresh(llama_path, block_size), fresh(llama_path, block_size)
    assert plain.blocks_per_seq == blocks_for(CACHE_LEN, block_size)
    want = run_steps(plain, identity(plain, [2, 0, 3]))
    got = run_steps(mixed, shuffled(mixed, 3))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_interleaved_rows_attend_only_their_own_blocks(llama_path):
    """Row 0 owns the even blocks, row 1 the odd ones: each row's logits equal its own run
    alone (in a fresh pool, the slot layout)."""
    model = fresh(llama_path, 4)
    m = model.blocks_per_seq
    tables = torch.tensor(
        [[2 * i for i in range(m)], [2 * i + 1 for i in range(m)]], dtype=torch.int32
    )
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 96, (2, 30), generator=g)
    both = model.forward_extend(prompts, tables, torch.zeros(2), torch.tensor([30, 30]))
    for row in range(2):
        alone = fresh(llama_path, 4)
        want = alone.forward_extend(prompts[row : row + 1], [0], [0], [30])
        torch.testing.assert_close(both[row], want[0], rtol=1e-5, atol=1e-5)


def test_padding_tokens_write_only_the_scratch_block(llama_path):
    model = fresh(llama_path, 8)
    caches = [
        c
        for layer in model.model.layers
        for c in (layer.self_attn.kv_cache.k_cache, layer.self_attn.kv_cache.v_cache)
    ]
    for cache in caches:
        cache.fill_(7.0)  # a sentinel: what stays untouched
    tables = shuffled(model, 3, seed=2)
    ids = torch.randint(3, 96, (3, 6))
    # row 0: 6 valid tokens at 10..15; row 1: 2 valid at 0..1 (4 padding); row 2: padding only
    model.forward_static(ids, tables, torch.tensor([10, 0, 40]), torch.tensor([6, 2, 0]), 64)
    written = {int(tables[0, 1]), int(tables[1, 0])}  # positions 10..15: block 1; 0..1: 0
    scratch = model.num_blocks
    for cache in caches:
        touched = {b for b in range(scratch + 1) if (cache[b] != 7.0).any()}
        assert touched - {scratch} == written, touched
        assert (cache[int(tables[0, 1]), :, :2] == 7.0).all()  # offsets 0, 1: not 8, 9
        assert (cache[int(tables[1, 0]), :, 2:] == 7.0).all()  # offsets 2..7


def test_runner_takes_device_tables_as_a_static_input(llama_path):
    """StepRunner steps with shuffled tables (the same tensor object twice: copied once)
    equal forward_extend over the slot layout; the fixed tables of a shard are one tensor
    per slot list."""
    plain, mixed = fresh(llama_path, 8), fresh(llama_path, 8)
    runner = StepRunner(mixed, CPU, max_batch=4, max_step_len=5)
    tables = shuffled(mixed, 3, seed=5)
    g = torch.Generator().manual_seed(7)
    for seq, starts, n_valid in STEPS:
        ids = torch.randint(3, 96, (3, seq), generator=g)
        want = plain.forward_extend(ids, [1, 3, 0], torch.tensor(starts), torch.tensor(n_valid))
        got = runner.run(ids, tables, starts, n_valid)
        for b, n in enumerate(n_valid):
            torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-5, atol=1e-5)
    books = SlotTables(ROWS, mixed.blocks_per_seq, mixed.num_blocks, mixed.block_size, CPU)
    assert books.rows([2, 0]) is books.rows([2, 0])
    assert books.rows([2, 0]).tolist() == slot_block_table([2, 0], mixed.blocks_per_seq)


def test_block_size_config_and_budget(llama_path):
    assert RuntimeConfig().kv_block_size == 16
    with pytest.raises(ConfigError, match="runtime.kv_block_size"):
        RuntimeConfig(kv_block_size=0)
    model = fresh(llama_path, 5)
    allocated = sum(
        b.numel() * b.element_size()
        for name, b in model.named_buffers()
        if name.endswith(("k_cache", "v_cache"))
    )
    assert cache_bytes(model, ROWS, CACHE_LEN, 5) == allocated
    with pytest.raises(ValueError, match="max_seq_len"):  # 64 positions, though 65 fit
        model.forward_extend(torch.zeros(1, 2, dtype=torch.long), [0], [63], [2])
