"""Synthetic draft/target pairs with random weights, for benchmarks and GPU checks.

Target: a Llama-family model of one of SHAPES (runtime.models.loading.synthetic_shapes:
Llama, Qwen3, OLMo 2, Phi-3; normal weights, std 0.02, seed 0; norm weights 1). Draft: the
target's first K layers sharing its embeddings, final norm and LM head. The target's layers
from K on have o_proj and down_proj scaled by eps (OLMo 2: their post-norm weights, see
synthetic_shapes), so the draft's agreement with the target falls as eps grows. Every FLOP
is real; acceptance is measured, never assumed.

Each tensor is drawn from its own generator, seeded by (seed, tensor name), so a tensor has
the same values however the pair is built or sharded. A pair is either written out as
safetensors (`build_pair(materialize=True)`, what transformers needs) or kept as a recipe: a
directory with config.json and synthetic.json, whose weights SyntheticWeights draws on the
loading device, tensor by tensor (a 70b target then needs no 141 GB on disk, and each
tensor-parallel rank draws only what it keeps plus one full tensor at a time). Values drawn
on a GPU differ from the CPU's for the same seed, but not between GPUs of the same model.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.models.loading.synthetic_shapes import SHAPES, config, eps_scaled, layer_shapes

RECIPE_FILE = "synthetic.json"


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: the pair's seed and the tensor's name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def draw_tensor(
    name: str,
    shape: tuple[int, ...],
    seed: int,
    dtype: torch.dtype,
    device: torch.device | str,
    scale: float = 1.0,
) -> torch.Tensor:
    """One weight on `device`: `scale` for norms, else normal(0, 0.02) * scale."""
    if len(shape) == 1:
        return torch.full(shape, scale, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return t.mul_(0.02 * scale).to(dtype)


def tensor_plan(
    shape: str, role: str, draft_layers: int, eps: float
) -> dict[str, tuple[tuple[int, ...], float]]:
    """HF name -> (shape, scale) of every tensor of the draft or the target."""
    s = SHAPES[shape]
    embed = (s["vocab_size"], s["hidden_size"])
    plan = {
        "model.embed_tokens.weight": (embed, 1.0),
        "model.norm.weight": ((s["hidden_size"],), 1.0),
        "lm_head.weight": (embed, 1.0),
    }
    layers = draft_layers if role == "draft" else s["num_hidden_layers"]
    shapes, scaled_names = layer_shapes(shape), eps_scaled(shape)
    for layer in range(layers):
        for name, shp in shapes.items():
            scaled = layer >= draft_layers and name in scaled_names
            plan[f"model.layers.{layer}.{name}"] = (shp, eps if scaled else 1.0)
    return plan


class SyntheticWeights:
    """The weights of a synthetic recipe directory, drawn on `device` when read (a
    runtime.models.loading.weights.WeightSource)."""

    def __init__(self, directory: str | Path, device: torch.device | str = "cpu"):
        recipe = json.loads((Path(directory) / RECIPE_FILE).read_text())
        self.seed, self.device = int(recipe["seed"]), torch.device(device)
        self.dtype = getattr(torch, recipe["dtype"])
        self.plan = tensor_plan(
            recipe["shape"], recipe["role"], int(recipe["draft_layers"]), float(recipe["eps"])
        )

    def names(self) -> set[str]:
        return set(self.plan)

    def get(self, name: str) -> torch.Tensor:
        shape, scale = self.plan[name]
        return draw_tensor(name, shape, self.seed, self.dtype, self.device, scale)

    def get_shard(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        from runtime.models.loading.weights import read_shard

        full = self.get(name)
        return read_shard(full.__getitem__, full.shape, dim, start, stop).clone()

    def close(self) -> None:
        pass


SHARD_BYTES = 2 << 30  # target checkpoints are written in shards of about this size


class _ShardWriter:
    """Writes tensors into safetensors shards of about `shard_bytes` as they come, so a big
    synthetic model never sits in host memory whole; a single shard is `model.safetensors`,
    several get HF's `model-0000i-of-0000n.safetensors` names and an index json."""

    def __init__(self, path: Path, shard_bytes: int):
        self.path, self.shard_bytes = path, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        path.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.path / name))
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        total = len(self.files)
        if total == 1:
            (self.path / self.files[0][0]).rename(self.path / "model.safetensors")
            return
        weight_map = {}
        for i, (tmp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            (self.path / tmp).rename(self.path / final)
            weight_map.update(dict.fromkeys(names, final))
        (self.path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
        )


def build_pair(
    out_dir: str | Path,
    shape: str = "tiny",
    draft_layers: int = 2,
    eps: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shard_bytes: int = SHARD_BYTES,
    gen_device: str | torch.device = "cpu",
    materialize: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[str, str]:
    """Write draft/ and target/ under out_dir; returns their paths.

    materialize=True writes safetensors shards, drawing one tensor at a time on gen_device
    (host memory holds about one shard; 8b: 16 GB on disk in bf16, 70b: 141 GB; the CPU
    generator takes minutes for 8b, so draw on a GPU when there is one). materialize=False
    writes only config.json and the recipe (synthetic.json): loading then draws the weights
    on the loading device (runtime.models.loading.loader.load_weights, whose `progress` then counts
    the tensors drawn). `progress(done, total)` hears of every tensor drawn and written here
    (draft and target together; materialize=True only)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if shape not in SHAPES:
        raise ValueError(f"unknown synthetic shape {shape!r}; choose from {', '.join(SHAPES)}")
    s = SHAPES[shape]
    if not 1 <= draft_layers <= s["num_hidden_layers"]:
        raise ValueError(f"draft_layers must be in 1..{s['num_hidden_layers']}")
    out = Path(out_dir)
    dtype_name = str(dtype).removeprefix("torch.")
    plans = {role: tensor_plan(shape, role, draft_layers, eps) for role in ("draft", "target")}
    done, total = 0, sum(len(plan) for plan in plans.values())
    if materialize and progress is not None:
        progress(done, total)
    for role, layers in (("draft", draft_layers), ("target", s["num_hidden_layers"])):
        path = out / role
        if materialize:
            writer = _ShardWriter(path, shard_bytes)
            for name, (shp, scale) in plans[role].items():
                writer.add(name, draw_tensor(name, shp, seed, dtype, gen_device, scale).cpu())
                done += 1
                if progress is not None:
                    progress(done, total)
            writer.close()
        else:
            path.mkdir(parents=True, exist_ok=True)
            recipe = {
                "shape": shape,
                "role": role,
                "draft_layers": draft_layers,
                "eps": eps,
                "seed": seed,
                "dtype": dtype_name,
            }
            (path / RECIPE_FILE).write_text(json.dumps(recipe, indent=1))
        conf = dict(config(shape, layers), torch_dtype=dtype_name)
        (path / "config.json").write_text(json.dumps(conf, indent=1))
    return str(out / "draft"), str(out / "target")
