"""FP8 checkpoints in every format tandem recognises, written from a tiny float checkpoint,
and their references: float32 checkpoints holding the dequantized weights, which transformers
reads as ordinary models (transformers itself is never asked to read FP8).

The quantization here is written independently of runtime.models.arch.quant (plain torch), so the
tests compare tandem's reading of each format with what the format's tools would write.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# fused checkpoint projections (Phi-3): per output channel, quantizing the stack is
# quantizing each part
FUSED_LINEARS = ("self_attn.qkv_proj", "mlp.gate_up_proj")

# name: (method, weight scales, activations); methods as in runtime.models.loading.fp8_formats
FORMATS = {
    "ct-channel-static": ("compressed-tensors", "channel", "static"),
    "ct-tensor-dynamic": ("compressed-tensors", "tensor", "dynamic"),
    "ct-channel-weight-only": ("compressed-tensors", "channel", "none"),
    "fp8-static": ("fp8", "tensor", "static"),
    "fp8-dynamic": ("fp8", "tensor", "dynamic"),
    "fbgemm": ("fbgemm_fp8", "channel", "dynamic"),
    "modelopt": ("modelopt", "tensor", "static"),
}


def quantize(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale): scale amax / 448 of the whole tensor (a 0-d tensor) or of each
    output row ([out, 1]); values cast round-to-nearest."""
    w = weight.float()
    if strategy == "tensor":
        scale = w.abs().max() / 448.0
    else:
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    return (w / scale).clamp(-448.0, 448.0).to(FP8), scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight an FP8 layer computes with."""
    return w8.float() * scale.float().reshape(-1, 1)


def _scale_shape(method: str, strategy: str, scale: torch.Tensor) -> torch.Tensor:
    """The scale tensor as each format stores it."""
    if strategy == "channel":
        return scale.reshape(-1, 1)  # [out, 1]
    if method == "compressed-tensors":
        return scale.reshape(1)  # [1]
    return scale.reshape(())  # AutoFP8 / ModelOpt: a scalar


def _config(method: str, strategy: str, activations: str, ignore: list[str]) -> dict:
    """config.json's quantization_config (ModelOpt: hf_quant_config.json's content)."""
    if method == "compressed-tensors":
        acts = (
            None
            if activations == "none"
            else {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "tensor" if activations == "static" else "token",
                "dynamic": activations == "dynamic",
            }
        )
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": strategy,
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": acts,
                    "output_activations": None,
                }
            },
            "ignore": ignore,
        }
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": activations, "ignored_layers": ignore}
    if method == "fbgemm_fp8":
        return {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ignore,
        }
    return {
        "producer": {"name": "modelopt", "version": "0.19.0"},
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8",
            "exclude_modules": ignore,
        },
    }


def write_fp8(
    float_dir: str,
    out_dir: str | Path,
    fmt: str,
    ignore: list[str] | None = None,
    keep_float: tuple[str, ...] = (),
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[str, str]:
    """(FP8 checkpoint, float32 reference) from the single-file float checkpoint float_dir.

    `ignore`: the format's ignore entries (default ['lm_head']); `keep_float`: the module names
    those entries select among the linears, which stay float."""
    method, strategy, activations = FORMATS[fmt]
    ignore = ["lm_head"] if ignore is None else ignore
    out = Path(out_dir)
    fp8_dir, ref_dir = out / "fp8", out / "reference"
    for d in (fp8_dir, ref_dir):
        d.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(Path(float_dir) / "model.safetensors"))
    stored, reference = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        quantized = (
            name.endswith(".weight") and module.endswith(LINEARS) and module not in keep_float
        )
        if not quantized:
            stored[name] = reference[name] = tensor
            continue
        w8, scale = quantize(tensor, strategy)
        scale = scale.to(scale_dtype)
        stored[name] = w8
        stored[f"{module}.weight_scale"] = _scale_shape(method, strategy, scale)
        reference[name] = dequantize(w8, scale)
        if activations == "static":  # any calibrated value: tandem reads none of them
            stored[f"{module}.input_scale"] = _scale_shape(method, "tensor", torch.tensor(0.02))
        if method == "modelopt" and module.endswith(("k_proj", "v_proj")):
            kind = module.rpartition(".")[2][0]  # k or v
            stored[f"{module}.{kind}_scale"] = torch.tensor(1.0)  # KV-cache scales
    save_file(stored, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(float_dir) / "config.json").read_text())
    for name in ("generation_config.json",):
        if (Path(float_dir) / name).is_file():
            for d in (fp8_dir, ref_dir):
                shutil.copy(Path(float_dir) / name, d / name)
    (ref_dir / "config.json").write_text(json.dumps(config, indent=1))
    quant = _config(method, strategy, activations, ignore)
    if method == "modelopt":
        (fp8_dir / "hf_quant_config.json").write_text(json.dumps(quant, indent=1))
    else:
        config["quantization_config"] = quant
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=1))
    return str(fp8_dir), str(ref_dir)


def write_quantized_reference(float_dir: str, out_dir: str | Path) -> str:
    """The float32 reference of `quantization: fp8` on float_dir: every linear quantized per
    output channel (amax / 448) and dequantized again."""
    tensors = load_file(str(Path(float_dir) / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(
            LINEARS + FUSED_LINEARS
        ):
            tensors[name] = dequantize(*quantize(tensor, "channel"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        if (Path(float_dir) / name).is_file():
            shutil.copy(Path(float_dir) / name, out / name)
    return str(out)
