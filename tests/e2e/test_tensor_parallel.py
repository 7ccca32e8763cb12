"""runtime.models.arch.parallelize: Megatron-style TP of our Llama-family model, on CPU with gloo.

One gloo world of 3 ranks is spawned per module; it runs every checkpoint variant with TP 2
(ranks 0-1, a group of their own) and then TP 3. Each rank compares its TP logits with a TP 1
model it loads itself and writes what it saw to a JSON file; the tests below check those.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch

from parallel.groups import TPInfo
from runtime.models import load_model
from tests.checkpoints import build_checkpoint
from tests.model_helpers import build_sharded_checkpoint

pytestmark = pytest.mark.timeout(300)

F32 = torch.float32
CPU = torch.device("cpu")
TOL = 1e-5
WORLD_TIMEOUT_S = 240  # whole spawned world, start to join
# gloo: a rank stuck in a collective fails instead of hanging. Generous, because rank 2 waits
# in its first TP 3 collective while ranks 0-1 run the TP 2 phase.
COLLECTIVE_TIMEOUT_S = 120

# name -> (arch, overrides). Shapes are chosen so that TP 2 and TP 3 see KV-head splitting and
# replication, vocabs that do not divide by the TP size, biases (qwen2 q/k/v, llama o/down),
# tied embeddings, an uneven MLP split, a sharded checkpoint and a sliding window.
VARIANTS = {
    # 4 heads / 2 KV: TP 2 splits the KV heads; vocab 97 pads the last shard; 4 heads: TP 3 error
    "llama_v97": ("llama", dict(vocab_size=97)),
    # 4 heads / 1 KV (replicated on TP 2), o_proj / down_proj biases, 2 safetensors shards
    "llama_bias_sharded": (
        "llama",
        dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True, sharded=True),
    ),
    # 6 heads / 1 KV (replicated: TP 2 x2, TP 3 x3), q/k/v biases, tied, vocab 97, MLP 100
    "qwen2_tied": (
        "qwen2",
        dict(
            vocab_size=97,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=1,
            intermediate_size=100,
            tie_word_embeddings=True,
        ),
    ),
    # 6 heads / 3 KV: TP 3 splits the KV heads; TP 2 cannot shard 3 KV heads (error)
    "llama_6h3kv": ("llama", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)),
    # sliding window under TP 2
    "mistral_window": ("mistral", dict(sliding_window=4)),
}
TP2_OK = ["llama_v97", "llama_bias_sharded", "qwen2_tied", "mistral_window"]
TP2_ERR = ["llama_6h3kv"]
TP3_OK = ["qwen2_tied", "llama_6h3kv"]
TP3_ERR = ["llama_v97"]


# ------------------------------------------------------------------------------ child side


class _SliceRecorder:
    def __init__(self, part, name: str, log: list):
        self._part, self._name, self._log = part, name, log

    def get_shape(self):
        return self._part.get_shape()

    def get_dtype(self):
        return self._part.get_dtype()

    def __getitem__(self, index):
        out = self._part[index]
        self._log.append(["slice", self._name, list(out.shape), list(self._part.get_shape())])
        return out


class _HandleRecorder:
    """Stands in for a safe_open handle and records every read with its shape."""

    def __init__(self, handle, log: list):
        self._handle, self._log = handle, log

    def keys(self):
        return self._handle.keys()

    def get_tensor(self, name):
        out = self._handle.get_tensor(name)
        self._log.append(["full", name, list(out.shape), list(out.shape)])
        return out

    def get_slice(self, name):
        return _SliceRecorder(self._handle.get_slice(name), name, self._log)


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _calls(vocab: int) -> list[list[tuple[int, int, list[int]]]]:
    """forward_extend calls, each a ragged batch of rows (slot, start_pos, ids)."""
    t = lambda seed, n: _tokens(seed, n, vocab)  # noqa: E731
    return [
        [(0, 0, t(1, 7))],  # prefill
        [(0, 7, t(2, 1))],  # incremental
        [(1, 0, t(3, 5)), (2, 0, t(4, 3)), (0, 8, t(5, 2))],  # ragged batch, mixed phases
        [(0, 10, t(6, 4))],  # draft tokens (k = 4)
        [(0, 11, t(7, 3)), (1, 5, t(8, 1))],  # rollback slot 0 to 11
        [(0, 14, t(9, 1)), (2, 3, t(10, 4))],  # continue after the rollback
    ]


def _extend(model, rows) -> tuple[torch.Tensor, list[torch.Tensor]]:
    width = max(len(ids) for _, _, ids in rows)
    input_ids = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, (_, _, ids) in enumerate(rows):
        input_ids[b, : len(ids)] = torch.tensor(ids)
    out = model.forward_extend(
        input_ids,
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows]),
        torch.tensor([len(r[2]) for r in rows]),
    )
    return out, [out[b, : len(ids)] for b, (_, _, ids) in enumerate(rows)]


def _run_case(path: str, tp: TPInfo) -> dict:
    from runtime.models.loading import weights as weights_mod

    ref = load_model(path, F32, CPU)
    log: list = []
    original = weights_mod.SafetensorsWeights._handle
    weights_mod.SafetensorsWeights._handle = lambda self, p: _HandleRecorder(original(self, p), log)
    try:
        model = load_model(path, F32, CPU, tp)
    finally:
        weights_mod.SafetensorsWeights._handle = original
    local = load_model(path, F32, CPU, tp, gather_logits=False)
    vocab = ref.vocab_size
    for m in (ref, model, local):
        m.allocate_cache(num_slots=3, max_seq_len=32)

    diffs, shapes = [], []
    for rows in _calls(vocab):
        (want_full, want), (got_full, got) = _extend(ref, rows), _extend(model, rows)
        shapes.append(list(got_full.shape))
        assert got_full.shape == want_full.shape, (got_full.shape, want_full.shape)
        diffs.append(max((g - w).abs().max().item() for g, w in zip(got, want)))

    # gather_logits=False: this rank's vocab slice, padding columns -inf
    rows = _calls(vocab)[0]
    (_, want), (local_full, got) = _extend(ref, rows), _extend(local, rows)
    v0, v1 = local.lm_head.vocab_start, local.lm_head.vocab_stop
    real = max(0, min(v1, vocab) - v0)
    local_diff = (got[0][:, :real] - want[0][:, v0 : v0 + real]).abs().max().item()
    padding_is_neg_inf = bool(torch.isneginf(got[0][:, real:]).all())

    attn = model.model.layers[0].self_attn
    plan = model.tp_plan
    tp_shards = {name: list(shard) for name, shard in model.tp_shards.items()}
    full_shapes = {name: list(p.shape) for name, p in ref.named_parameters()}
    local_shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    return dict(
        diffs=diffs,
        shapes=shapes,
        vocab=vocab,
        local_shape=list(local_full.shape),
        local_diff=local_diff,
        padding_is_neg_inf=padding_is_neg_inf,
        vocab_slice=[v0, v1],
        n_heads=attn.n_heads,
        n_kv_heads=attn.n_kv_heads,
        q_heads=list(plan.q_heads),
        kv_heads=list(plan.kv_heads),
        kv_replicas=plan.kv_replicas,
        intermediate=list(plan.intermediate),
        cache_shape=list(attn.kv_cache.k_cache.shape),
        tied=model.lm_head.weight is model.model.embed_tokens.weight,
        reads=log,
        tp_shards=tp_shards,
        full_shapes=full_shapes,
        local_shapes=local_shapes,
    )


def _child(rank: int, world_size: int, port: int, phases: list, out_dir: str) -> None:
    """One rank of a gloo world. Each phase (tp_size, cases, expect_error) runs on ranks
    [0, tp_size) over a group of its own, passed explicitly; the result file holds
    {f"tp{tp_size}": {case name: what this rank saw}}."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    result: dict = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        # every rank creates every group (new_group is collective over the world)
        groups = [dist.new_group(list(range(size)), backend="gloo") for size, _, _ in phases]
        for (size, cases, expect_error), group in zip(phases, groups):
            if rank >= size:
                continue
            tp = TPInfo.from_group(group)
            seen = result[f"tp{size}"] = {}
            for name, path in cases.items():
                seen[name] = _run_case(path, tp)
            for name, path in expect_error.items():
                try:
                    load_model(path, F32, CPU, tp)
                except ValueError as exc:
                    seen[name] = {"error": str(exc)}
                else:
                    seen[name] = {"error": None}
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["__error__"] = traceback.format_exc()
    finally:
        tmp = Path(out_dir) / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(Path(out_dir) / f"rank{rank}.json")
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(
    size: int, phases: list, out_dir: Path, timeout_s: float = WORLD_TIMEOUT_S
) -> list[dict]:
    """Spawn `size` gloo ranks running _child; always join (or terminate, then kill) them."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = [
        ctx.Process(target=_child, args=(r, size, port, phases, str(out_dir)), daemon=True)
        for r in range(size)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not any(p.is_alive() for p in procs), "TP ranks left running"
    results = []
    for r in range(size):
        f = out_dir / f"rank{r}.json"
        assert f.exists(), (
            f"rank {r} wrote no result (hung ranks: {hung}, exit codes: "
            f"{[p.exitcode for p in procs]})"
        )
        res = json.loads(f.read_text())
        assert "__error__" not in res, f"rank {r} failed:\n{res['__error__']}"
        results.append(res)
    assert not hung, f"ranks {hung} did not exit within {timeout_s} s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def _build(name: str, root: Path) -> str:
    arch, overrides = VARIANTS[name]
    overrides = dict(overrides)
    if overrides.pop("sharded", False):
        return build_sharded_checkpoint(root / name, arch=arch, seed=5, **overrides)
    return build_checkpoint(root / name, arch=arch, seed=5, **overrides)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_ckpt")
    return {name: _build(name, root) for name in VARIANTS}


@pytest.fixture(scope="module")
def world(checkpoints, tmp_path_factory) -> list[dict]:
    """One spawned world of 3 ranks: TP 2 over ranks 0-1 (rank 2 goes straight on), then
    TP 3 over all; spawning once saves two interpreter starts."""

    def pick(names):
        return {n: checkpoints[n] for n in names}

    phases = [(2, pick(TP2_OK), pick(TP2_ERR)), (3, pick(TP3_OK), pick(TP3_ERR))]
    return run_world(3, phases, tmp_path_factory.mktemp("tp_world"))


@pytest.fixture(scope="module")
def tp2(world) -> list[dict]:
    return [res["tp2"] for res in world[:2]]


@pytest.fixture(scope="module")
def tp3(world) -> list[dict]:
    return [res["tp3"] for res in world]


def _world(request, size: int) -> list[dict]:
    return request.getfixturevalue(f"tp{size}")


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("size,name", [(2, n) for n in TP2_OK] + [(3, n) for n in TP3_OK])
def test_logits_match_tp1(request, size, name):
    """Prefill, incremental, ragged batch, draft + rollback: full [B, T, V] logits on every
    rank, equal to TP 1 within 1e-5."""
    for rank, res in enumerate(_world(request, size)):
        case = res[name]
        assert all(shape[-1] == case["vocab"] for shape in case["shapes"]), case["shapes"]
        assert max(case["diffs"]) < TOL, f"rank {rank}: {case['diffs']}"


def test_vocab_not_divisible_pads_last_shard(tp2, tp3):
    # vocab 97: TP 2 -> [0, 49), [49, 98) (one padding row); TP 3 -> 33 rows each (two)
    assert [r["llama_v97"]["vocab_slice"] for r in tp2] == [[0, 49], [49, 98]]
    assert [r["qwen2_tied"]["vocab_slice"] for r in tp3] == [[0, 33], [33, 66], [66, 99]]
    for res in (*tp2, *tp3):
        for case in res.values():
            if "shapes" in case:
                assert case["vocab"] in (96, 97)
                assert all(s[-1] == case["vocab"] for s in case["shapes"])


def test_gather_logits_false_returns_local_vocab_slice(tp2, tp3):
    for res in (*tp2, *tp3):
        for name, case in res.items():
            if "shapes" not in case:
                continue
            v0, v1 = case["vocab_slice"]
            assert case["local_shape"][-1] == v1 - v0, name
            assert case["local_diff"] < TOL, name
            assert case["padding_is_neg_inf"], name


def test_kv_heads_split_and_replicated(tp2, tp3):
    def layout(world, name):
        return [
            (
                r[name]["n_heads"],
                r[name]["n_kv_heads"],
                tuple(r[name]["q_heads"]),
                tuple(r[name]["kv_heads"]),
                r[name]["kv_replicas"],
            )
            for r in world
        ]

    # 4 heads / 2 KV on TP 2: split
    assert layout(tp2, "llama_v97") == [(2, 1, (0, 2), (0, 1), 1), (2, 1, (2, 4), (1, 2), 1)]
    # 4 heads / 1 KV on TP 2: replicated twice
    assert layout(tp2, "llama_bias_sharded") == [
        (2, 1, (0, 2), (0, 1), 2),
        (2, 1, (2, 4), (0, 1), 2),
    ]
    # 6 heads / 1 KV on TP 3: replicated three times
    assert layout(tp3, "qwen2_tied") == [
        (2, 1, (0, 2), (0, 1), 3),
        (2, 1, (2, 4), (0, 1), 3),
        (2, 1, (4, 6), (0, 1), 3),
    ]
    # 6 heads / 3 KV on TP 3: split
    assert layout(tp3, "llama_6h3kv") == [
        (2, 1, (0, 2), (0, 1), 1),
        (2, 1, (2, 4), (1, 2), 1),
        (2, 1, (4, 6), (2, 3), 1),
    ]


def test_kv_cache_sized_per_rank(tp2, tp3):
    # [3 slots x 2 blocks of 16 positions + the scratch block, local KV heads, 16, head_dim]
    for res in tp2:
        assert res["llama_v97"]["cache_shape"] == [3 * 2 + 1, 1, 16, 16]
    for res in tp3:
        assert res["qwen2_tied"]["cache_shape"] == [3 * 2 + 1, 1, 16, 16]


def test_uneven_mlp_split_and_tied_embeddings(tp3):
    assert [r["qwen2_tied"]["intermediate"] for r in tp3] == [[0, 33], [33, 66], [66, 100]]
    assert all(r["qwen2_tied"]["tied"] for r in tp3)
    for r in tp3:
        shards = r["qwen2_tied"]["tp_shards"]
        assert shards["lm_head.weight"] == shards["model.embed_tokens.weight"]


def test_each_rank_reads_only_its_slices(tp2, tp3):
    for res in (*tp2, *tp3):
        for name, case in res.items():
            if "reads" not in case:
                continue
            shards, reads = case["tp_shards"], case["reads"]
            read_names = [n for _, n, _, _ in reads]
            assert len(read_names) == len(set(read_names)), f"{name}: a tensor read twice"
            for kind, tensor, got, full in reads:
                if tensor in shards:
                    dim, start, stop = shards[tensor]
                    assert kind == "slice", f"{name}: {tensor} read whole"
                    want = list(full)
                    want[dim] = min(stop, full[dim]) - min(start, full[dim])
                    assert got == want, (name, tensor, got, want)
            # the big ones are always sharded, never read in full (k/v_proj may be whole when
            # a single KV head is replicated onto every rank)
            for tensor in (
                "model.embed_tokens.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.1.mlp.gate_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
            ):
                assert tensor in shards, (name, tensor)
                [(kind, got, full)] = [(k, g, f) for k, n, g, f in reads if n == tensor]
                assert kind == "slice" and math.prod(got) < math.prod(full), (name, tensor, got)


def test_row_parallel_bias_replicated(tp2):
    # o_proj / down_proj biases are whole on every rank (added once after the all-reduce)
    for res in tp2:
        case = res["llama_bias_sharded"]
        for name in ("model.layers.0.self_attn.o_proj.bias", "model.layers.1.mlp.down_proj.bias"):
            assert name not in case["tp_shards"]
            assert case["local_shapes"][name] == case["full_shapes"][name] == [64]
        assert case["local_shapes"]["model.layers.0.self_attn.o_proj.weight"] == [64, 32]


def test_heads_not_dividing_raise_in_ranks(tp2, tp3):
    for res in tp2:
        msg = res["llama_6h3kv"]["error"]
        assert msg and "num_key_value_heads 3" in msg and "size 2" in msg, msg
        assert "llama_6h3kv" in msg, msg  # names the model (its path)
    for res in tp3:
        msg = res["llama_v97"]["error"]
        assert msg and "num_attention_heads 4" in msg and "size 3" in msg, msg
        assert "llama_v97" in msg, msg
