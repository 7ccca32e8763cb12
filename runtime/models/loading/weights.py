"""Weight sources: read checkpoint tensors by HF parameter name, whole or one shard of them.

`get(name)` reads a whole tensor; `get_shard(name, dim, start, stop)` reads rows [start, stop)
along `dim` (a tensor-parallel rank's slice, see runtime.models.arch.parallelize). Rows past the
end of
the tensor come back as zeros: that is how a vocab that does not divide by the TP size is padded.

SafetensorsWeights reads lazily: get_shard goes through safe_open(...).get_slice(name)[...], so
only the shard's bytes are read and no full tensor is ever materialized.
GGUFWeights is lazy too, but llama.cpp's quantized blocks cannot be sliced: each tensor is
dequantized (by the gguf package) on its own, when asked for, then transformers' tensor
processor reverses llama.cpp's q/k permutation, then the shard is cut out and copied. So a TP
rank holds at most one full float32 tensor at a time beyond its own shards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightSource(Protocol):
    def names(self) -> set[str]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def get_shard(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor: ...

    def close(self) -> None: ...


def read_shard(
    read: Callable[[tuple], torch.Tensor], shape: Iterable[int], dim: int, start: int, stop: int
) -> torch.Tensor:
    """Rows [start, stop) along `dim` of a tensor of `shape`, read with `read(index tuple)`;
    rows past the end are zero-padded."""
    shape = list(shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"shard dim {dim} out of range for shape {tuple(shape)}")
    if not 0 <= start <= stop:
        raise ValueError(f"bad shard range [{start}, {stop})")
    end = min(stop, shape[dim])
    index = (slice(None),) * dim + (slice(min(start, end), end),)
    part = read(index)
    if end - min(start, end) < stop - start:  # pad the rows past the end with zeros
        pad_shape = list(part.shape)
        pad_shape[dim] = stop - start - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad_shape)], dim=dim)
    return part


class SafetensorsWeights:
    """Tensors of an HF checkpoint directory: sharded (index json), single, or any *.safetensors."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._file_of = self._weight_map()  # tensor name -> file path
        self._handles: dict[Path, Any] = {}

    def _weight_map(self) -> dict[str, Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: self.directory / f for name, f in weight_map.items()}
            missing = sorted({str(f) for f in files.values() if not f.is_file()})
            if missing:
                raise FileNotFoundError(
                    f"{index} lists weight files that do not exist: {', '.join(missing)}"
                )
            return files
        shards = sorted(self.directory.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(
                f"no safetensors weights in {self.directory} (expected "
                f"{SINGLE_FILE} or {INDEX_FILE} with its shards)"
            )
        from safetensors import safe_open

        files = {}
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                files.update((name, shard) for name in f.keys())
        return files

    def _handle(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
        return self._handles[path]

    def names(self) -> set[str]:
        return set(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self._file_of[name]).get_tensor(name)

    def get_slice(self, name: str):
        """safetensors slice object: index it (e.g. [rows]) to read only part of the tensor."""
        return self._handle(self._file_of[name]).get_slice(name)

    def get_shard(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along `dim`, read from the file without reading the rest."""
        part = self.get_slice(name)
        return read_shard(part.__getitem__, part.get_shape(), dim, start, stop)

    def close(self) -> None:
        self._handles.clear()


class _NameOnlyModel:
    """Just enough of a transformers model for transformers.get_gguf_hf_weights_map."""

    def __init__(self, config: Any, names: Iterable[str]):
        self.config = config
        self._names = list(names)

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self._names)

    def named_children(self):
        return iter(())


class GGUFWeights:
    """Tensors of a .gguf file under HF names, each dequantized to float32 when it is read."""

    def __init__(self, path: str | os.PathLike, config: Any, param_names: Iterable[str]):
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            read_field,
        )

        self._reader: GGUFReader | None = GGUFReader(str(path))
        architecture = read_field(self._reader, "general.architecture")[0]
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(
            config=config.to_dict()
        )
        # one call with a flat name list: transformers' own recursion over modules is slow
        self._name_map = get_gguf_hf_weights_map(
            _NameOnlyModel(config, param_names), self._processor
        )
        self._tensor_of: dict[str, Any] = {}  # HF name -> gguf ReaderTensor
        self.unmapped: list[str] = []
        for tensor in self._reader.tensors:
            if tensor.name in self._name_map:
                self._tensor_of[self._name_map[tensor.name]] = tensor
            else:
                self.unmapped.append(tensor.name)

    def names(self) -> set[str]:
        return set(self._tensor_of)

    def dequantized_nbytes(self) -> int:
        """Bytes of all the tensors once dequantized to float32 (runtime.models.loading.gguf_cache
        caches them below a size limit)."""
        return sum(int(tensor.n_elements) * 4 for tensor in self._tensor_of.values())

    def get(self, name: str) -> torch.Tensor:
        """Dequantize one tensor (float32) and undo llama.cpp's layout."""
        from gguf import dequantize

        tensor = self._tensor_of[name]
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = self._processor.process(
            weights=weights,
            name=tensor.name,
            tensor_key_mapping=self._name_map,
            parsed_parameters={"tensors": {}},
        )
        if result.name != tensor.name:  # llama / mistral / qwen2 processors never rename
            raise NotImplementedError(
                f"gguf tensor {tensor.name}: the tensor processor renamed it to {result.name}"
            )
        return torch.from_numpy(result.weights.copy())

    def get_shard(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Dequantize the whole tensor (quantized blocks cannot be sliced), then keep a copy of
        rows [start, stop) along `dim` only."""
        full = self.get(name)
        return read_shard(full.__getitem__, full.shape, dim, start, stop).clone()

    def close(self) -> None:
        self._tensor_of.clear()
        self._reader = None
