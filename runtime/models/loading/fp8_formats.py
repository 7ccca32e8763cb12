"""Which FP8 checkpoint format a Hugging Face directory holds, read from its metadata only.

Recognised (`read_format`):

- compressed-tensors (llm-compressor): config.json `quantization_config` with `quant_method:
  compressed-tensors`, `format: float-quantized` (top level or per group), config groups whose
  `weights` are 8-bit `float`, symmetric, static, `strategy: tensor | channel`, and whose
  `input_activations` are absent, static `tensor` (an `input_scale` per layer) or dynamic
  `token`/`tensor`; `ignore` lists names or `re:` patterns of layers left in float.
- `quant_method: fp8` (AutoFP8, vLLM): per-tensor `weight_scale`, `activation_scheme: static`
  (with `input_scale`) or `dynamic`; `ignored_layers` / `modules_to_not_convert`. Block-wise
  FP8 (`weight_block_size`, `weight_scale_inv`) is not supported.
- `quant_method: fbgemm_fp8`: per-channel `weight_scale` [out, 1], dynamic per-token
  activations; `modules_to_not_convert`.
- ModelOpt: `hf_quant_config.json` with `quantization.quant_algo: FP8` (or the same keys
  flat in config.json's `quantization_config` with `quant_method: modelopt`): per-tensor
  weight and input scales; `exclude_modules` (glob patterns).

Tensor names are the checkpoint's: `<layer>.weight` (F8_E4M3), `<layer>.weight_scale`, and
optionally `<layer>.input_scale`. KV-cache scales (`k_scale`, `v_scale`, `kv_scale`) are
accepted and not used: the KV cache stays in the activation dtype. How the weights are read
and which layers run in FP8: runtime.models.loading.fp8_load.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass

from runtime.models.loading.checkpoint import _read_json

QUANT_FILE = "hf_quant_config.json"  # ModelOpt's
# per-layer tensors of FP8 checkpoints that tandem reads nothing from (see the docstring)
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")
SUPPORTED = "compressed-tensors (float-quantized), fp8, fbgemm_fp8, ModelOpt FP8"


@dataclass(frozen=True)
class FP8Format:
    """An FP8 checkpoint's declared layout."""

    method: str  # compressed-tensors | fp8 | fbgemm_fp8 | modelopt
    weights: tuple[str, ...]  # weight scale strategies: tensor and/or channel
    activations: str  # static | dynamic | none (weight-only)
    ignore: tuple[str, ...] = ()  # layers the checkpoint keeps in float

    def ignores(self, module: str) -> bool:
        """Whether `module` (e.g. 'lm_head', 'model.layers.0.mlp.down_proj') is declared
        unquantized, with the matching rules of the format's own tools."""
        for entry in self.ignore:
            if self.method == "compressed-tensors":
                hit = re.match(entry[3:], module) if entry.startswith("re:") else entry == module
            elif self.method == "modelopt":
                hit = fnmatch.fnmatchcase(module, entry) or entry == module
            else:  # transformers: a substring of the name
                hit = entry in module
            if hit:
                return True
        return False


def read_format(path: str | os.PathLike) -> FP8Format | None:
    """The FP8 format of the checkpoint at `path`; None for a float checkpoint, a .gguf file
    or a synthetic recipe. ValueError naming the field for a quantization tandem cannot run."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    modelopt = os.path.join(path, QUANT_FILE)
    if os.path.isfile(modelopt):
        return _modelopt(_read_json(modelopt).get("quantization"), modelopt)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return None
    config = _read_json(config_file)
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    where = f"{config_file}: quantization_config"
    if not isinstance(qc, dict):
        raise ValueError(f"{where} is not an object")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method == "fp8":
        return _fp8(qc, where)
    if method == "fbgemm_fp8":
        return FP8Format(
            "fbgemm_fp8", ("channel",), "dynamic", tuple(qc.get("modules_to_not_convert") or ())
        )
    if method == "modelopt":
        return _modelopt(qc.get("quantization", qc), where)
    raise ValueError(
        f"{where}.quant_method {method!r} is not supported: tandem runs float "
        f"checkpoints and FP8 ones ({SUPPORTED})"
    )


def _fp8(qc: dict, where: str) -> FP8Format:
    if qc.get("weight_block_size") is not None:
        raise ValueError(
            f"{where}.weight_block_size {qc['weight_block_size']}: block-wise FP8 "
            f"is not supported (per-tensor and per-channel scales are)"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"{where}.activation_scheme {scheme!r}: expected static or dynamic")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt {fmt!r}: only e4m3 FP8 is supported")
    ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
    return FP8Format("fp8", ("tensor",), scheme, ignore)


def _modelopt(q, where: str) -> FP8Format:
    if not isinstance(q, dict) or "quant_algo" not in q:
        raise ValueError(f"{where}: no quantization.quant_algo")
    if q["quant_algo"] != "FP8":
        raise ValueError(f"{where}: quant_algo {q['quant_algo']!r} is not supported (FP8 is)")
    return FP8Format("modelopt", ("tensor",), "static", tuple(q.get("exclude_modules") or ()))


def _compressed_tensors(qc: dict, where: str) -> FP8Format:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}.config_groups: expected at least one group")
    strategies, activations = set(), set()
    for name, group in groups.items():
        key = f"{where}.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise ValueError(f"{key}: format {fmt!r} is not supported (float-quantized is)")
        strategies.add(_ct_weights(group.get("weights"), f"{key}.weights"))
        activations.add(_ct_activations(group.get("input_activations"), f"{key}.input_activations"))
        if group.get("output_activations") is not None:
            raise ValueError(f"{key}.output_activations: output quantization is not supported")
    acts = activations.pop() if len(activations) == 1 else "mixed"
    return FP8Format(
        "compressed-tensors", tuple(sorted(strategies)), acts, tuple(qc.get("ignore") or ())
    )


def _ct_float8(args, key: str) -> None:
    if not isinstance(args, dict):
        raise ValueError(f"{key}: expected an object")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(
            f"{key}: num_bits {args.get('num_bits')!r} type "
            f"{args.get('type')!r}: only 8-bit float (FP8) is supported"
        )
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{key}.symmetric: only symmetric FP8 is supported")


def _ct_weights(args, key: str) -> str:
    _ct_float8(args, key)
    strategy = args.get("strategy", "tensor")
    if strategy not in ("tensor", "channel") or args.get("dynamic", False):
        raise ValueError(
            f"{key}: strategy {strategy!r} (dynamic {args.get('dynamic')!r}) is "
            f"not supported: static tensor or channel weight scales are"
        )
    return strategy


def _ct_activations(args, key: str) -> str:
    if args is None:
        return "none"
    _ct_float8(args, key)
    strategy, dynamic = args.get("strategy", "tensor"), bool(args.get("dynamic", False))
    if (strategy, dynamic) == ("tensor", False):
        return "static"
    if dynamic and strategy in ("token", "tensor"):
        return "dynamic"
    raise ValueError(
        f"{key}: strategy {strategy!r} dynamic {dynamic} is not supported "
        f"(static tensor, dynamic token or dynamic tensor are)"
    )
