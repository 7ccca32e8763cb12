# temporary: CPU vs CUDA parity of runtime/rng.py and runtime/sampling.py (deleted after use)
import time, torch
from runtime.rng import uniform
from runtime.sampling import warp_probs, sample_from, accept_rejection, accept_tokens
dev = "cuda"
g = torch.Generator().manual_seed(0)
seed = torch.randint(0, 2**62, (512,), generator=g); pos = torch.randint(0, 2**40, (512, 9), generator=g)
for s in (0, 1, 2):
    for dt in (torch.float32, torch.float64):
        assert torch.equal(uniform(seed, pos, s, dt), uniform(seed.to(dev), pos.to(dev), s, dt).cpu())
print("rng bitwise equal")
B, n, V = 64, 5, 32000
logits = torch.randn(B, n, V, generator=g) * 4
logits[::2] = (logits[::2] * 2).round() / 2
T = torch.tensor([0., .3, .7, 1., 1.3])[torch.randint(0, 5, (B,), generator=g)]
K = torch.tensor([0, 1, 5, 50, 1000])[torch.randint(0, 5, (B,), generator=g)]
P = torch.tensor([1., .95, .9, .5, 0.])[torch.randint(0, 5, (B,), generator=g)]
a = warp_probs(logits, T, K, P); b = warp_probs(logits.to(dev), T.to(dev), K.to(dev), P.to(dev)).cpu()
print("warp mask equal", torch.equal(a > 0, b > 0), "max diff", (a - b).abs().max().item())
u = torch.rand(B, n, generator=g); u[:, 0] = 1 - 2**-24; u[:, 1] = 0
tc = sample_from(b.to(dev), u.to(dev)).cpu(); t = sample_from(a, u)
print("sample equal", torch.equal(t, tc), "zero-prob picks", (b.gather(-1, tc[..., None]) == 0).sum().item())
uu = torch.rand(200000, 1, generator=g).to(dev); big = b[:1, 3:4].to(dev).expand(200000, 1, V)
tb = sample_from(big, uu); print("zero-prob picks (200k)", (big[:, 0].gather(-1, tb) == 0).sum().item())
d = sample_from(a[:, :4], u[:, :4]); q = a[:, :4]
r1 = accept_rejection(d, q, a, u[:, :4], u); r2 = accept_rejection(d.to(dev), q.to(dev), a.to(dev), u[:, :4].to(dev), u.to(dev))
print("accept_rejection equal", all(torch.equal(x, y.cpu()) for x, y in zip(r1, r2)))
r1 = accept_tokens(d, a, u); r2 = accept_tokens(d.to(dev), a.to(dev), u.to(dev))
print("accept_tokens equal", all(torch.equal(x, y.cpu()) for x, y in zip(r1, r2)))
ad, Td, Kd, Pd = logits.to(dev).bfloat16(), T.to(dev), K.to(dev), P.to(dev)
Vb = 128256; lg = torch.randn(64, 5, Vb, device=dev, dtype=torch.bfloat16)
sd, ps = seed[:64].to(dev), pos[:64, :5].to(dev)
for name, fn in [("uniform[64,5]", lambda: uniform(sd, ps, 1)), ("warp[64,5,128k]", lambda: warp_probs(lg, Td, Kd, Pd)),
                 ("sample[64,5,128k]", lambda: sample_from(pr, ps.float() * 0))]:
    pr = warp_probs(lg, Td, Kd, Pd)
    for _ in range(3): fn()
    torch.cuda.synchronize(); t0 = time.time()
    for _ in range(20): fn()
    torch.cuda.synchronize(); print(name, f"{(time.time() - t0) / 20 * 1e3:.2f} ms")
