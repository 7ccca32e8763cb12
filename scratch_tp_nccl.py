"""Temporary: NCCL check of parallel/ TP on 2 GPUs (deleted after use)."""
import datetime, os, sys, tempfile, traceback
import torch, torch.distributed as dist, torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(rank, size, port, paths):
    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=60),
                                device_id=dev)
        group = dist.new_group(list(range(size)), backend="nccl")
        from parallel.mappings import all_gather_last_dim, all_reduce
        from parallel.tensor_parallel import TPInfo
        from runtime.models import load_model
        x = torch.full((2, 3, 4), float(rank + 1), device=dev)
        assert torch.equal(all_reduce(x.clone(), group), torch.full_like(x, sum(range(1, size + 1))))
        y = torch.arange(24., device=dev).view(2, 3, 4) + 100 * rank
        g = all_gather_last_dim(y, group)
        want = torch.cat([torch.arange(24., device=dev).view(2, 3, 4) + 100 * r for r in range(size)], -1)
        assert torch.equal(g, want), "all_gather_last_dim"
        tp = TPInfo.from_group(group)
        for name, path in paths.items():
            for dtype in (torch.float32, torch.bfloat16):
                ref = load_model(path, dtype, dev)
                m = load_model(path, dtype, dev, tp)
                for mm in (ref, m):
                    mm.allocate_cache(2, 32)
                ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0)).to(dev)
                args = (torch.tensor([0, 1], device=dev), torch.tensor([0, 0], device=dev), torch.tensor([9, 6], device=dev))
                a, b = ref.forward_extend(ids, *args), m.forward_extend(ids, *args)
                d1 = (a[0] - b[0]).abs().max().item()
                ids2 = ids[:, :2]
                args2 = (torch.tensor([0, 1], device=dev), torch.tensor([5, 6], device=dev), torch.tensor([2, 1], device=dev))
                a, b = ref.forward_extend(ids2, *args2), m.forward_extend(ids2, *args2)
                d2 = (a[0] - b[0]).abs().max().item()
                print(f"rank {rank} {name} {dtype}: shape {tuple(b.shape)} maxdiff prefill {d1:.2e} rollback {d2:.2e} scale {a.abs().max().item():.2f}", flush=True)
        dist.barrier(group)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from tests.checkpoints import build_checkpoint
    tmp = tempfile.mkdtemp()
    paths = {
        "llama_v97": build_checkpoint(f"{tmp}/a", "llama", vocab_size=97),
        "qwen2_tied_1kv": build_checkpoint(f"{tmp}/b", "qwen2", vocab_size=97, num_key_value_heads=1,
                                           tie_word_embeddings=True, intermediate_size=100),
    }
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.start_processes(child, args=(2, port, paths), nprocs=2, start_method="spawn", join=True)
    print("NCCL TP OK")
