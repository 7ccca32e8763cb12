"""Loading FP8 weights: which layers run in FP8, and a weight source that hands them over.

`prepare(model, source, path, quantization, device)` runs between building the (meta,
possibly TP-sharded) model and runtime.models.loading.loader.load_weights:

- `quantization: null` ("as stored"): the linears whose checkpoint has a `weight_scale` run
  in FP8, as stored (runtime.models.loading.fp8_formats says which formats are recognised); the
  format's ignore list must agree with the tensors (a declared FP8 layer without scales, or
  an ignored one with them, is an error). Float checkpoints load as before.
- `quantization: fp8`: every q/k/v/o/gate/up/down projection runs in FP8; those the
  checkpoint stores in FP8 are taken as stored, the float ones (safetensors, a dequantized
  GGUF tensor, a synthetic recipe's draw) are quantized per output channel as they are read
  (quant.quantize_rows, on the loading device), one tensor at a time: neither host nor device
  ever holds a float copy of the whole model.

Scales are always handed over per output channel, [out] float32 (a per-tensor scale is
expanded), so tensor-parallel shards cut them with the weight rows. Quantizing on load is
independent of the TP layout: a row-parallel shard (input columns) is cut from the whole
tensor's quantization, so every rank computes with the weights a single device would.
A tensor stored in FP8 that the model keeps in float (an FP8 `lm_head`) is dequantized.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from runtime.models.arch.fp8_linears import to_fp8
from runtime.models.arch.parallelize import SHARDED
from runtime.models.arch.quant import FP8, QUANTIZED, dequantize, quantize_rows
from runtime.models.loading.fp8_formats import UNUSED_SUFFIXES, FP8Format, read_format
from runtime.models.loading.weights import WeightSource, read_shard

Shard = tuple[int, int, int]  # (dim, start, stop) as in parallel.layers.Shard


def fp8_modules(
    model: nn.Module, names: set[str], fmt: FP8Format | None, quantization: str | None
) -> list[str]:
    """The names of the model's linears that run in FP8 (see the module docstring)."""
    candidates = [
        name
        for name, module in model.named_modules()
        if name.rpartition(".")[2] in QUANTIZED and isinstance(module, nn.Linear)
    ]
    stored = [m for m in candidates if f"{m}.weight_scale" in names]
    if quantization == "fp8":
        return candidates
    if quantization is not None:
        raise ValueError(f"unknown quantization {quantization!r}: null (as stored) or fp8")
    if fmt is None:
        if stored:
            raise ValueError(
                f"the checkpoint holds FP8 scales ({stored[0]}.weight_scale, ...) "
                f"but declares no quantization_config"
            )
        return []
    for module in candidates:
        declared = not fmt.ignores(module)
        if declared != (module in stored):
            what = (
                "declares it FP8 (not in its ignore list) but it has no weight_scale"
                if declared
                else "ignores it but it has a weight_scale"
            )
            raise ValueError(f"{fmt.method} checkpoint: {module}: the quantization config {what}")
    return stored


def prepare(
    model: nn.Module,
    source: WeightSource,
    path: str | os.PathLike,
    quantization: str | None,
    device: torch.device,
) -> WeightSource:
    """Turn the model's FP8 linears into FP8 layers (on meta) and return the source to load
    from: `source` itself for a float model, else an FP8Source over it."""
    fmt = read_format(path)
    names = source.names()
    modules = fp8_modules(model, names, fmt, quantization)
    stored_fp8 = {n.rpartition(".")[0] for n in names if n.endswith(".weight_scale")}
    if not modules and not stored_fp8:
        return source
    shards = getattr(model, "tp_shards", None)
    for name in modules:
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear)  # fp8_modules' candidates
        to_fp8(module)
        if shards is not None and isinstance(module, SHARDED):  # the scale shards too
            shards.update({f"{name}.{p}": s for p, s in module.shards().items()})
    return FP8Source(source, set(modules), stored_fp8, device)


class FP8Source:
    """A WeightSource (runtime.models.loading.weights) for a model with FP8 linears: their
    `weight` in e4m3 and `weight_scale` as [out] float32, stored or quantized on read."""

    def __init__(
        self, inner: WeightSource, modules: set[str], stored: set[str], device: torch.device
    ):
        self.inner, self.device = inner, torch.device(device)
        self.modules = modules  # run in FP8
        self.stored = stored & modules  # ... and stored in FP8
        self.dequant = stored - modules  # stored in FP8, run in float
        self._names = inner.names()
        self._pending: dict[tuple, torch.Tensor] = {}  # scales quantized with their weight

    def names(self) -> set[str]:
        names = {n for n in self._names if not n.endswith(UNUSED_SUFFIXES)}
        names -= {f"{m}.weight_scale" for m in self.dequant}
        return names | {f"{m}.weight_scale" for m in self.modules}

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, None)

    def get_shard(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self._read(name, (dim, start, stop))

    def close(self) -> None:
        self._pending.clear()
        self.inner.close()

    # -- one tensor -----------------------------------------------------------------------
    def _read(self, name: str, shard: Shard | None) -> torch.Tensor:
        module, _, attr = name.rpartition(".")
        if module in self.stored and attr == "weight":
            return self._stored_weight(name, shard)
        if module in self.stored and attr == "weight_scale":
            return self._stored_scale(module, shard)
        if module in self.modules and attr in ("weight", "weight_scale"):
            return self._quantized(module, attr, shard)
        if module in self.dequant and attr == "weight":
            scale_rows = shard if shard is not None and shard[0] == 0 else None
            return dequantize(
                self._stored_weight(name, shard).to(self.device),
                self._stored_scale(module, scale_rows).to(self.device),
            )
        return self._raw(name, shard)

    def _raw(self, name: str, shard: Shard | None) -> torch.Tensor:
        return self.inner.get(name) if shard is None else self.inner.get_shard(name, *shard)

    def _stored_weight(self, name: str, shard: Shard | None) -> torch.Tensor:
        weight = self._raw(name, shard)
        if weight.dtype != FP8:
            raise ValueError(
                f"checkpoint tensor {name} is {weight.dtype}, but its layer has a "
                f"weight_scale: expected float8_e4m3fn (safetensors F8_E4M3)"
            )
        return weight

    def _stored_scale(self, module: str, shard: Shard | None) -> torch.Tensor:
        """The layer's stored scale as [out] float32 (per-tensor expanded), rows of `shard`
        (dim 0) or whole (a row-parallel shard keeps every output channel)."""
        rows = self._rows(f"{module}.weight")
        scale = self.inner.get(f"{module}.weight_scale").float()
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(rows)
        elif scale.numel() == rows:
            scale = scale.reshape(rows)
        else:
            raise ValueError(
                f"checkpoint tensor {module}.weight_scale has shape "
                f"{tuple(scale.shape)}: neither per-tensor nor per-channel for "
                f"a weight of {rows} rows (block or group scales are not "
                f"supported)"
            )
        if shard is None or shard[0] != 0:
            return scale.contiguous()
        return read_shard(scale.__getitem__, scale.shape, 0, shard[1], shard[2]).contiguous()

    def _rows(self, name: str) -> int:
        if hasattr(self.inner, "get_slice"):  # safetensors: from the header
            return int(self.inner.get_slice(name).get_shape()[0])
        return int(self.inner.get(name).shape[0])

    def _quantized(self, module: str, attr: str, shard: Shard | None) -> torch.Tensor:
        """Quantize-on-load. The weight's rows are quantized whole (amax over every input
        column); a scale is kept until its read comes (the loader reads `weight` first)."""
        rows_shard = shard if shard is not None and shard[0] == 0 else None
        key = (module, rows_shard)
        if attr == "weight_scale" and key in self._pending:
            return self._pending.pop(key)
        weight = self._raw(f"{module}.weight", rows_shard).to(self.device)
        w8, scale = quantize_rows(weight)
        del weight
        if attr == "weight_scale":
            return scale
        self._pending[key] = scale
        if shard is not None and shard[0] == 1:  # row-parallel: input columns of the whole
            w8 = w8[:, shard[1] : shard[2]].contiguous()
        return w8
