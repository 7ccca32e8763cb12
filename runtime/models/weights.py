"""Weight sources: read checkpoint tensors by HF parameter name.

SafetensorsWeights reads lazily (one tensor, or one slice of it, at a time) so a
tensor-parallel rank can read only its shard. GGUFWeights dequantizes the file once and
reverses llama.cpp's tensor layout (q/k permutation) with transformers' own tensor processors.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Protocol

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightSource(Protocol):
    def names(self) -> set[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


class SafetensorsWeights:
    """Tensors of an HF checkpoint directory: sharded (index json), single, or any *.safetensors."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._file_of = self._weight_map()                      # tensor name -> file path
        self._handles: dict[Path, Any] = {}

    def _weight_map(self) -> dict[str, Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: self.directory / f for name, f in weight_map.items()}
            missing = sorted({str(f) for f in files.values() if not f.is_file()})
            if missing:
                raise FileNotFoundError(f"{index} lists weight files that do not exist: "
                                        f"{', '.join(missing)}")
            return files
        shards = sorted(self.directory.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no safetensors weights in {self.directory} (expected "
                                    f"{SINGLE_FILE} or {INDEX_FILE} with its shards)")
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
    """All tensors of a .gguf file, dequantized to float32 and renamed to HF names."""

    def __init__(self, path: str | os.PathLike, config: Any, param_names: Iterable[str]):
        from gguf import GGUFReader, dequantize
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map, read_field)

        reader = GGUFReader(str(path))
        architecture = read_field(reader, "general.architecture")[0]
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
        # one call with a flat name list: transformers' own recursion over modules is slow
        name_map = get_gguf_hf_weights_map(_NameOnlyModel(config, param_names), processor)
        parsed: dict[str, Any] = {"tensors": {}}
        self.unmapped: list[str] = []
        for tensor in reader.tensors:
            weights = dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=weights, name=tensor.name,
                                       tensor_key_mapping=name_map, parsed_parameters=parsed)
            if result.name not in name_map:
                self.unmapped.append(tensor.name)
                continue
            parsed["tensors"][name_map[result.name]] = torch.from_numpy(result.weights.copy())
        self._tensors: dict[str, torch.Tensor] = parsed["tensors"]

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def close(self) -> None:
        self._tensors.clear()
