"""Distributed argmax over a vocab-parallel last dimension equals torch.argmax over the full
vocabulary, ties included (two gloo ranks on CPU)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.discovery import free_port
from parallel.vocab import VocabParallel

pytestmark = pytest.mark.timeout(120)

SIZE, V = 2, 11  # vocab 11 over 2 ranks: slices of 6, last one padded


def full_logits() -> torch.Tensor:
    torch.manual_seed(0)
    logits = torch.randint(0, 4, (3, 5, V)).float()  # few values: many exact ties
    logits[0, 0, 2] = logits[0, 0, 8] = 9.0  # tie across the two slices
    logits[1, 1, 10] = 9.0  # max at the very last real id
    return logits


def child(rank: int, port: int, out) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        per = -(-V // SIZE)
        start = rank * per
        padded = torch.full((3, 5, per * SIZE), float("-inf"))
        padded[..., :V] = full_logits()
        local = padded[..., start : start + per]
        vp = VocabParallel(dist.group.WORLD, start, V)
        out.put((rank, vp.argmax(local).tolist(), vp.gather(local).tolist()))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_argmax_and_gather():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=child, args=(r, port, out)) for r in range(SIZE)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=90) for _ in range(SIZE)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    expected = full_logits()
    for _, argmax, gathered in results:
        assert argmax == expected.argmax(-1).tolist()
        assert torch.equal(torch.tensor(gathered), expected)
    assert all(p.exitcode == 0 for p in procs)
