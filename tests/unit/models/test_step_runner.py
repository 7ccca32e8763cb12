"""runtime.models.runners.step_runner (static-shape decode/verify steps, CUDA graphs on CUDA),
grouped-query attention and the KV cache memory budget, on CPU: the static path that the
graphs capture must give the logits of the dynamic forward_extend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.models import load_model
from runtime.models.arch.attention import grouped_attention
from runtime.models.arch.elementwise import stack_heads
from runtime.models.runners.graphs import batch_buckets, kv_bucket
from runtime.models.runners.kv_budget import cache_bytes, check_kv_budget
from runtime.models.runners.step_runner import StepRunner
from runtime.worker.draft_shard import DraftShard

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
CACHE_LEN = 300  # above the first KV bucket (256), so both a bucket and the cap are used


def fresh(path: str, slots: int = 8):
    model = load_model(path, torch.float32, CPU)
    model.allocate_cache(slots, CACHE_LEN)
    return model


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert [kv_bucket(n, 10_000) for n in (1, 256, 257, 1500, 2049, 4097)] == [
        256,
        256,
        512,
        2048,
        4096,
        6144,
    ]
    assert kv_bucket(290, CACHE_LEN) == CACHE_LEN


@pytest.mark.parametrize("seq", [3, 40], ids=["matmul-softmax", "sdpa"])
def test_grouped_attention_equals_repeated_kv(seq):
    g = torch.Generator().manual_seed(0)
    bsz, heads, kv_heads, dim, length = 2, 6, 2, 8, 47
    q = torch.randn(bsz, seq, heads, dim, generator=g)
    k = torch.randn(bsz, kv_heads, length, dim, generator=g)
    v = torch.randn(bsz, kv_heads, length, dim, generator=g)
    mask = torch.rand(bsz, 1, seq, length, generator=g) > 0.3
    mask[..., 0] = True
    rep = heads // kv_heads
    k_rep = k.repeat_interleave(rep, dim=1)  # [B, H, L, D]
    v_rep = v.repeat_interleave(rep, dim=1)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k_rep, v_rep, attn_mask=mask)
    out = grouped_attention(stack_heads(q, kv_heads), k, v, mask, seq)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slots", [[5, 0, 2], [0, 1, 2]], ids=["gather", "contiguous"])
def test_static_steps_equal_dynamic_forward(llama_path, slots):
    """Batch 3 (padded to 4), ragged step lengths, KV lengths crossing the 256 bucket."""
    dynamic, static = fresh(llama_path), fresh(llama_path)
    runner = StepRunner(static, CPU, max_batch=8, max_step_len=4)
    g = torch.Generator().manual_seed(1)
    lengths = [250, 3, 40]
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]
    for model in (dynamic, static):
        for slot, prompt in zip(slots, prompts):
            model.forward_extend(
                torch.tensor([prompt]),
                torch.tensor([slot]),
                torch.tensor([0]),
                torch.tensor([len(prompt)]),
            )
    starts = list(lengths)
    for step in range(5):
        n_valid = [1 + (step + b) % 4 for b in range(3)]
        ids = torch.randint(3, 96, (3, 4), generator=g)
        want = dynamic.forward_extend(
            ids, torch.tensor(slots), torch.tensor(starts), torch.tensor(n_valid)
        )
        got = runner.run(ids, slots, starts, n_valid)
        for b, n in enumerate(n_valid):
            torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-4, atol=1e-4)
        starts = [s + n for s, n in zip(starts, n_valid)]
    assert max(starts) > 256 and runner.graphs == {}  # no capture on CPU


def test_draft_shard_with_and_without_static_steps(llama_path):
    """Proposals are identical whether steps run at static or dynamic shapes."""
    proposals = []
    for graphs in (True, False):
        shard = DraftShard(fresh(llama_path), CPU, 8, CACHE_LEN, max_step_len=2, cuda_graphs=graphs)
        shard.runner.static = graphs
        shard.prefill([1, 4], [[5, 6, 7, 8], [9, 10]])
        proposals.append(shard.propose([1, 4], 5)[0].tolist())
    assert proposals[0] == proposals[1]


def test_cache_bytes_match_allocation(llama_path):
    model = fresh(llama_path, slots=3)
    allocated = sum(
        b.numel() * b.element_size()
        for name, b in model.named_buffers()
        if name.endswith(("k_cache", "v_cache"))
    )
    assert cache_bytes(model, 3, CACHE_LEN) == allocated


def test_kv_budget_too_small_names_the_key(llama_path):
    model = load_model(llama_path, torch.float32, CPU)
    check_kv_budget("target", model, 4, 64, None, CPU)  # fits in free memory
    with pytest.raises(MemoryError, match=r"target KV cache needs .* target.kv_cache_memory"):
        check_kv_budget("target", model, 4096, 4096, 1e-6, CPU)


def test_capture_all_enumerates_shapes_shortest_kv_first(llama_path, monkeypatch):
    runner = StepRunner(fresh(llama_path), CPU, max_batch=4, max_step_len=5)
    assert runner.capture_all([5]) == 0  # nothing to capture on CPU
    captured = []
    runner.capture = True
    monkeypatch.setattr(runner, "_capture", lambda key: captured.append(key))
    runner.capture_all([1, 5])
    assert len(captured) == 3 * 2 * 2  # batch 1/2/4, T 1/5, KV 256/300
    assert captured[0] == (1, 1, 256) and captured[-1] == (4, 5, CACHE_LEN)
    captured.clear()
    runner.capture_all([1, 5], limit=5)
    assert len(captured) == 5 and all(key[2] == 256 for key in captured)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("slots", [[0, 1], [3, 1]], ids=["contiguous", "gather"])
def test_compiled_kernels_equal_eager(llama_path, slots):
    """runtime.models.arch.fused compiled by torch.compile (on GPUs the graphs replay these): the
    same logits as the eager functions through prefill, decode and verify steps, and the KV
    cache written in place (the compiled rotary_write mutates the cache tensors themselves)."""
    from runtime.models.arch import fused

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (70, 9)]
    steps = [torch.randint(3, 96, (2, t), generator=g) for t in (1, 1, 4, 1, 3)]

    def run(compiled: bool) -> list[torch.Tensor]:
        model = fresh(llama_path)
        caches = [layer.self_attn.kv_cache.k_cache for layer in model.model.layers]
        pointers = [c.data_ptr() for c in caches]
        runner = StepRunner(model, CPU, max_batch=4, max_step_len=4)
        if compiled:
            assert fused.compile_kernels(CPU)
        try:
            out = [
                runner.run(torch.tensor([p]), [s], [0], [len(p)])[0, -1].clone()
                for s, p in zip(slots, prompts)
            ]
            starts = [len(p) for p in prompts]
            for ids in steps:
                n = [ids.shape[1], max(1, ids.shape[1] - 1)]  # ragged valid lengths
                out.append(runner.run(ids, slots, starts, n).clone())
                starts = [s + k for s, k in zip(starts, n)]
        finally:
            fused.use_eager()
        assert [c.data_ptr() for c in caches] == pointers
        assert all(c.abs().sum() > 0 for c in caches)
        return out

    for want, got in zip(run(False), run(True)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_cache_write_touches_only_the_new_rows(device):
    """The compiled rotary_write must scatter the new keys and values into the caches, not
    copy whole caches: through a transposed view of the cache, inductor (torch 2.11 on CUDA)
    cloned each cache, scattered into the clone and copied it back, 1 ms per 8b decode step
    with 16 slots. No kernel of the generated code may range over a whole cache."""
    from torch._inductor.utils import run_and_get_code

    from runtime.models.arch import fused

    slots_n, n_kv, length, dim = 7, 2, 53, 16  # cache numel 11872: a telltale size
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    q, k, v = rand(2, 3, 4, dim), rand(2, 3, n_kv, dim), rand(2, 3, n_kv, dim)
    cos, sin = rand(2, 3, dim), rand(2, 3, dim)
    slots = torch.tensor([5, 5, 5, 2, 2, 2], device=device)
    positions = torch.tensor([10, 11, 52, 0, 1, 2], device=device)  # 52: scratch
    eager = [torch.zeros(slots_n, n_kv, length, dim, device=device) for _ in range(2)]
    compiled = [c.clone() for c in eager]
    want = fused.rotary_write(q, k, v, cos, sin, *eager, slots, positions)
    fn = torch.compile(fused.rotary_write, fullgraph=True)
    with torch.no_grad():
        got, code = run_and_get_code(fn, q, k, v, cos, sin, *compiled, slots, positions)
    torch.testing.assert_close(got, want)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e)
    assert str(slots_n * n_kv * length * dim) not in "\n".join(code)
