"""Gemma 3 (text) and Gemma 2 beyond tests/unit/models/test_families.py (which checks their
logits against transformers eager, through StepRunner, at TP 2 and with FP8): each Gemma
difference the tiny checkpoints are built to show does move the logits (so those tests can
fail), the multimodal `gemma3` config stays on the fallback, and the Triton attention kernels
(decode/verify and prefill; per-layer scale, Gemma 2's soft-cap constexpr, windows, RoPE
folded in) equal the eager path under TRITON_INTERPRET=1 (a subprocess: tests/interpreted)."""

from __future__ import annotations

import pytest
import torch

from runtime.models import LlamaForCausalLM, load_model
from runtime.models.arch.model_args import unsupported_reason
from tests.checkpoints import build_checkpoint
from tests.interpreted import start_interpreted
from tests.model_helpers import extend, hf_logits

pytestmark = pytest.mark.timeout(300)

F32, CPU = torch.float32, torch.device("cpu")
ARCHS = ("gemma3_text", "gemma2")

KERNEL_CASE = r"""
import sys
import torch
from runtime.models import load_model
from runtime.models import kernels
from runtime.models.kernels import attention as attention_kernel, prefill_attention

torch.manual_seed(0)
eager, fast = (load_model(p, torch.float32, "cpu") for p in (sys.argv[1], sys.argv[1]))
for model in (eager, fast):
    model.allocate_cache(3, 80)
launches = []
kernel = prefill_attention.prefill_attention
def counted(*args, **kwargs):
    launches.append(1)
    return kernel(*args, **kwargs)
prefill_attention.prefill_attention = counted
tables = torch.arange(15, dtype=torch.int32).view(3, 5)
steps = [(torch.randint(3, 96, (2, 70)), torch.tensor([0, 0]), torch.tensor([70, 66])),
         (torch.randint(3, 96, (2, 4)), torch.tensor([70, 66]), torch.tensor([4, 2])),
         (torch.randint(3, 96, (2, 1)), torch.tensor([74, 68]), torch.tensor([1, 1]))]
for i, (ids, start, n) in enumerate(steps):
    kernels.disable()
    want = eager.forward_static(ids, tables[:2], start, n, kv_len=80)
    assert kernels.enable(torch.device("cpu"))
    attention_kernel.FOLD_ROPE_MIN_SEQ = 2          # verify: RoPE in the attention kernel
    got = fast.forward_static(ids, tables[:2], start, n, kv_len=80)
    ok = torch.arange(ids.shape[1])[None, :] < n[:, None]
    err = (got[ok] - want[ok]).abs().max().item()
    assert err < 1e-4, (i, err)
assert launches == [1] * fast.args.n_layers, launches   # the 70-token prefill only
print("ok")
"""


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma")
    return {arch: build_checkpoint(root / arch, arch, seed=5) for arch in ARCHS}


@pytest.fixture(scope="module")
def kernel_scripts(paths):
    """The interpreted kernel scripts, started at once (one core's work each)."""
    started = {arch: start_interpreted(KERNEL_CASE, paths[arch]) for arch in ARCHS}
    yield started
    for script in started.values():
        script.kill()


@pytest.mark.parametrize("arch", ARCHS)
def test_triton_kernels_equal_eager(kernel_scripts, arch):
    """A 70-token prefill (the prefill kernel: 2 x 70 stacked rows), a verify step (the
    slot kernel with RoPE folded in) and a decode step: the kernels' logits equal eager's."""
    kernel_scripts[arch].check()


def _no_window(model):
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None


def _no_attn_softcap(model):
    for layer in model.model.layers:
        layer.self_attn.softcap = None


def _default_scale(model):
    for layer in model.model.layers:
        layer.self_attn.scale = model.args.head_dim**-0.5


def _no_final_softcap(model):
    model.args.final_softcap = None


def _one_rope_table(model):
    model.rotary_by_type.clear()


def _no_embed_scale(model):
    model.model.embed_scale = None


ABLATIONS = {
    "gemma3_text": (
        _no_window,
        _default_scale,
        _no_final_softcap,
        _one_rope_table,
        _no_embed_scale,
    ),
    "gemma2": (_no_window, _no_attn_softcap, _default_scale, _no_final_softcap, _no_embed_scale),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_each_gemma_difference_moves_the_logits(paths, arch):
    """Undo one Gemma difference at a time on our model: the logits then miss transformers'
    by far more than the tolerance of the equality tests (1e-4)."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(paths[arch], dtype=F32).eval()
    seq = torch.randint(3, 96, (24,), generator=torch.Generator().manual_seed(9)).tolist()
    want = hf_logits(ref, seq)
    for ablate in (None, *ABLATIONS[arch]):
        model = load_model(paths[arch], F32, CPU)
        assert isinstance(model, LlamaForCausalLM)
        if ablate is not None:
            ablate(model)
        model.allocate_cache(1, 32)
        err = (extend(model, 0, 0, seq) - want).abs().max().item()
        if ablate is None:
            assert err < 1e-4
        else:
            assert err > 1e-2, (ablate.__name__, err)


def test_multimodal_gemma3_config_stays_on_the_fallback():
    """transformers' AutoModelForCausalLM loads a `gemma3` config as
    Gemma3ForConditionalGeneration (vision tower, model.language_model.* names): the
    transformers fallback, with its reason. Bidirectional Gemma 3 likewise."""
    import transformers

    reason = unsupported_reason(transformers.Gemma3Config())
    assert "'gemma3'" in reason and "transformers fallback" in reason
    text = transformers.Gemma3TextConfig(use_bidirectional_attention=True)
    assert "bidirectional" in unsupported_reason(text)
