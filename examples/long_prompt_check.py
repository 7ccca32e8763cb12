"""One long prompt at a CPU server (issue 43), end to end: bounded steps, every request
answered, output exact.

The scenario: a float32 Llama-shaped target of 1.10B parameters (the synthetic `1b` pair of
`tandem bench`: hidden 2048, 16 layers, 32,000-token vocabulary; its draft is its first 2
layers) served on the CPU by `tandem serve CONFIG --http HOST:PORT`, with
runtime.max_prefill_tokens left at its default. One client sends a PROMPT_LEN-token prompt
(3,000 random token ids: prefilled whole, the draft's and the target's work is 91 CPU seconds
of one thread, over a minute on two cores; docs/configuration.md, "Chunked prefill"),
MAX_TOKENS greedy tokens, streamed; SECOND_DELAY s later a second client sends a short prompt.
Meanwhile GET /metrics, which the serving loop answers between steps, is polled every second:
its slowest answer bounds how long one step held the loop.

Checks (exit 1 when one fails, saying which): the server starts; both requests complete with
MAX_TOKENS tokens each; their tokens equal the target alone's greedy tokens (transformers on
the same checkpoint, computed after the server stopped); every GET /metrics is answered (the
HTTP front waits 30 s for the serving loop: a longer step fails it); the server stops on SIGINT
with no process of its group left (SIGTERM, then SIGKILL, past their timeouts; every wait has
one).

The pair (materialized safetensors, ~5 GB) and a word-level tokenizer ("w0" .. "w31999", so
the HTTP API's text gives back the exact token ids) are built once under --cache-dir and
reused. Timings are printed: the server's start, each request's time to first token and
total, the slowest /metrics answer, the reference's time.

With --chunk-costs N1,N2,... it starts no server and measures instead what a worker's
prefill command of each budget costs over the PROMPT_LEN-token prompt (the draft's chunk, then
the target's, as a `prefill` command runs them, through the same model code and runners), and
the whole prompt in one command: in this process, on one thread, in CPU seconds, so the table
holds however busy the machine is (a worker's threads divide it, at best).
--demo measures the built-in demo model (SmolLM2-135M as draft and target) instead of the pair.

    python examples/long_prompt_check.py --cache-dir /tmp/tandem-long
    python examples/long_prompt_check.py --cache-dir /tmp/tandem-long --max-prefill-tokens 256
    python examples/long_prompt_check.py --cache-dir /tmp/tandem-long \\
        --chunk-costs 64,128,256,512,1024 [--demo]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

DRAFT_LAYERS, EPS, SEED = 2, 0.02, 0
MODEL_NAME = "long-check"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", required=True, help="the pair and tokenizer, built once")
    p.add_argument(
        "--shape",
        default="1b",
        help="the synthetic pair's shape (runtime.models.loading.synthetic_shapes; "
        "tiny: a quick run of the script itself)",
    )
    p.add_argument("--prompt-len", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--second-delay",
        type=float,
        default=5.0,
        help="seconds after the long request that the short one is sent",
    )
    p.add_argument("--second-len", type=int, default=16, help="the short prompt's tokens")
    p.add_argument(
        "--max-prefill-tokens",
        default=None,
        help="runtime.max_prefill_tokens (default: left out, the config default; "
        "'none': whole prompts)",
    )
    p.add_argument(
        "--chunk-costs",
        default=None,
        metavar="N1,N2,...",
        help="measure these budgets' prefill commands in this process instead (no server)",
    )
    p.add_argument("--demo", action="store_true", help="--chunk-costs of the built-in demo model")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--stop-timeout", type=float, default=60.0)
    return p.parse_args()


# --- the pair, the tokenizer, the config -----------------------------------------------------
def build(cache_dir: str, shape: str, vocab: int) -> tuple[str, str, str]:
    """(draft, target, tokenizer) directories under cache_dir, built when missing."""
    import torch

    from runtime.bench.settings import synthetic_pair

    draft, target, _ = synthetic_pair(
        shape,
        DRAFT_LAYERS,
        EPS,
        SEED,
        "float32",
        torch.device("cpu"),
        materialize=True,
        synthetic_dir=cache_dir,
    )
    tok_dir = os.path.join(cache_dir, f"words-{vocab}")
    if not os.path.isfile(os.path.join(tok_dir, "done")):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(tok_dir)
        open(os.path.join(tok_dir, "done"), "w").close()
    return draft, target, tok_dir


def write_config(
    path: str,
    draft: str,
    target: str,
    tokenizer: str,
    address: str,
    seq_len: int,
    budget: str | None,
) -> None:
    runtime = {"max_batch_size": 4, "max_seq_len": seq_len}
    if budget is not None:
        runtime["max_prefill_tokens"] = None if budget.lower() in ("none", "null") else int(budget)
    cfg = {
        "draft": {"model": draft, "devices": ["cpu:0"], "dtype": "float32"},
        "target": {"model": target, "devices": ["cpu:0"], "dtype": "float32"},
        "tokenizer": tokenizer,
        "speculation": {"draft_len": 4},
        "runtime": runtime,
        "server": {"address": address},
    }
    with open(path, "w") as fh:
        json.dump(cfg, fh, indent=1)  # JSON is YAML


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_ids(text: str) -> list[int]:
    """The word-level tokenizer's text back to its ids ("w12 w7" -> [12, 7])."""
    return [int(word[1:]) for word in text.split()]


# --- HTTP ------------------------------------------------------------------------------------
def request(url: str, body: dict | None, timeout: float):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until GET /v1/models answers (the server has its workers' info)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode} while starting")
        try:
            with request(f"{base}/v1/models", None, 10) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except (urllib.error.URLError, OSError, TimeoutError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


def completion(
    base: str, prompt: list[int], max_tokens: int, timeout: float, t0: float, out: dict
) -> None:
    """One streamed greedy completion; fills `out`: sent, first, done (s since t0), text."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    out["sent"] = time.perf_counter() - t0
    text = []
    deadline = time.perf_counter() + timeout
    try:
        with request(f"{base}/v1/completions", body, timeout) as r:
            for raw in r:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"no end within {timeout:.0f} s")
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    raise RuntimeError(f"error event: {msg['error']}")
                piece = msg["choices"][0].get("text") or ""
                if piece and "first" not in out:
                    out["first"] = time.perf_counter() - t0
                text.append(piece)
        out["done"] = time.perf_counter() - t0
        out["text"] = "".join(text)
    except Exception as exc:  # noqa: BLE001 (any failure is reported by the caller)
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["failed_at"] = time.perf_counter() - t0
        if isinstance(exc, urllib.error.HTTPError):
            out["error"] += " " + exc.read().decode(errors="replace")[:500]


def poll_metrics(base: str, stop: threading.Event, out: dict) -> None:
    """GET /metrics every second until `stop`: the slowest answer (the serving loop answers
    it between steps) and failures."""
    slowest, count, failures = 0.0, 0, []
    while not stop.is_set():
        start = time.perf_counter()
        try:
            with request(f"{base}/metrics", None, 300) as r:
                r.read()
            count += 1
        except Exception as exc:  # noqa: BLE001 (reported)
            failures.append(f"{type(exc).__name__}: {exc}")
        slowest = max(slowest, time.perf_counter() - start)
        stop.wait(1.0)
    out.update(slowest=slowest, count=count, failures=failures)


# --- the server's life -----------------------------------------------------------------------
def stop_server(proc: subprocess.Popen, timeout: float) -> list[str]:
    """SIGINT, then SIGTERM, then SIGKILL to the group, each after `timeout`; what went
    wrong (empty: stopped on SIGINT, nothing of its group left)."""
    problems = []
    pgid = proc.pid  # start_new_session: the server leads its own group, workers in it
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        if sig != signal.SIGINT:
            problems.append(
                f"tandem serve still running {timeout:.0f} s after the last "
                f"signal: sending {sig.name} to its group"
            )
        try:
            if sig == signal.SIGINT:
                proc.send_signal(sig)
            else:
                os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.perf_counter() + timeout  # its workers end after it
    while time.perf_counter() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return problems
        time.sleep(0.5)
    left = subprocess.run(
        ["ps", "-o", "pid=,args=", "-g", str(pgid)], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    problems.append(
        f"processes of the server's group left {timeout:.0f} s after it ended (killed now): {left}"
    )
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return problems


def reference(target: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target alone's greedy tokens, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


# --- --chunk-costs -----------------------------------------------------------------------------
def chunk_costs(draft: str, target: str, prompt: list[int], budgets: list[int]) -> None:
    """Print what each budget's prefill commands cost over `prompt` (one thread, CPU s)."""
    import torch

    from runtime.bench.tandem_modes import TandemTarget

    torch.set_num_threads(1)
    length = len(prompt)
    models = [
        TandemTarget(path, torch.float32, torch.device("cpu"), 1, length + 64, 8, False)
        for path in (draft, target)
    ]

    def command(at: int, size: int, final: bool) -> float:
        """One prefill command's CPU seconds: a chunk caches all but its last token; the
        prompt's end goes through, the target's with its first token's logits."""
        ids = torch.tensor([prompt[at : at + size]])
        start = time.thread_time()
        models[0].runner.prefill(
            ids[:, : size if final else size - 1], [0], [at], [size if final else size - 1]
        )
        if final:
            models[1].runner.prefill_last(ids, [0], [at], [size])
        else:
            models[1].runner.prefill(ids[:, : size - 1], [0], [at], [size - 1])
        return time.thread_time() - start

    def schedule(budget: int | None) -> list[tuple[int, int, bool]]:
        """The scheduler's chunks of the prompt (runtime.serving.scheduler._chunks)."""
        chunks, at = [], 0
        while budget is not None and length - at > budget:
            chunks.append((at, budget, False))
            at += budget - 1  # the chunk's last token starts the next
        return chunks + [(at, length - at, True)]

    command(0, 64, False)  # warm-up
    whole = command(*schedule(None)[0])
    print(f"{length}-token prompt, one thread, CPU seconds (draft + target)")
    print("| max_prefill_tokens | steps | step mean / max | time to first token | vs whole |")
    print("|---|---|---|---|---|")
    print(f"| whole prompt | 1 | {whole:.1f} | {whole:.1f} | 1.00 |")
    for budget in budgets:
        costs = [command(*chunk) for chunk in schedule(budget)]
        print(
            f"| {budget} | {len(costs)} | {sum(costs) / len(costs):.2f} / {max(costs):.2f} | "
            f"{sum(costs):.1f} | {sum(costs) / whole:.2f} |",
            flush=True,
        )


def main() -> int:
    args = parse_args()
    from runtime.models.loading.synthetic_shapes import SHAPES

    vocab = SHAPES[args.shape]["vocab_size"]
    rng = random.Random(1)
    if args.chunk_costs and args.demo:
        from runtime.config.paths import default_model_path

        prompt = [rng.randrange(49152) for _ in range(args.prompt_len)]  # SmolLM2's vocabulary
        budgets = [int(n) for n in args.chunk_costs.split(",")]
        chunk_costs(default_model_path(), default_model_path(), prompt, budgets)
        return 0
    t_build = time.perf_counter()
    draft, target, tok_dir = build(os.path.abspath(args.cache_dir), args.shape, vocab)
    print(f"pair and tokenizer: {time.perf_counter() - t_build:.1f} s ({target})", flush=True)
    long_prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    short_prompt = [rng.randrange(vocab) for _ in range(args.second_len)]
    if args.chunk_costs:
        chunk_costs(draft, target, long_prompt, [int(n) for n in args.chunk_costs.split(",")])
        return 0
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tandem-long-") as tmp:
        cfg = os.path.join(tmp, "config.yaml")
        write_config(
            cfg,
            draft,
            target,
            tok_dir,
            f"ipc://{tmp}/server.sock",
            args.prompt_len + args.max_tokens + 64,
            args.max_prefill_tokens,
        )
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = os.path.join(tmp, "serve.log")
        cmd = [
            sys.executable,
            "-m",
            "launcher",
            "serve",
            cfg,
            "--http",
            f"127.0.0.1:{port}",
            "--served-model-name",
            MODEL_NAME,
        ]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        long_out: dict = {}
        short_out: dict = {}
        metrics: dict = {}
        try:
            ready = wait_ready(base, proc, args.startup_timeout)
            from runtime.config.schema import RuntimeConfig

            budget = (
                args.max_prefill_tokens or f"{RuntimeConfig().max_prefill_tokens} (the default)"
            )
            print(
                f"server ready in {ready:.1f} s (pid {proc.pid}); max_prefill_tokens "
                f"{budget}; prompts of {args.prompt_len} and {args.second_len} tokens, "
                f"{args.max_tokens} new each",
                flush=True,
            )
            t0 = time.perf_counter()
            stop_polling = threading.Event()
            poller = threading.Thread(
                target=poll_metrics, args=(base, stop_polling, metrics), daemon=True
            )
            poller.start()
            first = threading.Thread(
                target=completion,
                daemon=True,
                args=(base, long_prompt, args.max_tokens, args.request_timeout, t0, long_out),
            )
            first.start()
            time.sleep(args.second_delay)
            second = threading.Thread(
                target=completion,
                daemon=True,
                args=(base, short_prompt, args.max_tokens, args.request_timeout, t0, short_out),
            )
            second.start()
            for thread in (first, second):
                thread.join(args.request_timeout + 60)
                if thread.is_alive():
                    failures.append("a request thread did not end within its timeout")
            stop_polling.set()
            poller.join(330)
        except Exception as exc:  # noqa: BLE001 (reported)
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            failures += stop_server(proc, args.stop_timeout)
            print(f"server stopped (exit code {proc.returncode})", flush=True)
            if failures or "error" in long_out or "error" in short_out:
                with open(log_path) as fh:
                    print("--- tandem serve's log (tail) ---\n" + fh.read()[-4000:], flush=True)

    for name, out in (("long", long_out), ("short", short_out)):
        if "error" in out:
            failures.append(f"{name} request failed at {out['failed_at']:.1f} s: {out['error']}")
        elif "done" in out:
            print(
                f"{name:5} request: sent {out['sent']:6.1f} s, first token "
                f"{out.get('first', float('nan')):6.1f} s, done {out['done']:6.1f} s "
                f"(TTFT {out.get('first', float('nan')) - out['sent']:.1f} s, total "
                f"{out['done'] - out['sent']:.1f} s)",
                flush=True,
            )
    if metrics:
        print(
            f"GET /metrics during the run: {metrics['count']} answers, the slowest in "
            f"{metrics['slowest']:.2f} s, {len(metrics['failures'])} failed",
            flush=True,
        )
        failures += [
            f"GET /metrics failed (the serving loop, held by a step, did not answer in time): {f}"
            for f in metrics["failures"][:3]
        ]

    got = {
        name: token_ids(out["text"])
        for name, out in (("long", long_out), ("short", short_out))
        if "text" in out
    }
    for name, ids in got.items():
        if len(ids) != args.max_tokens:
            failures.append(f"{name} request: {len(ids)} tokens, not {args.max_tokens}")
    if got:
        t_ref = time.perf_counter()
        names = list(got)
        want = reference(
            target, [long_prompt if n == "long" else short_prompt for n in names], args.max_tokens
        )
        print(
            f"reference (transformers, target alone, greedy): {time.perf_counter() - t_ref:.1f} s",
            flush=True,
        )
        for name, ref in zip(names, want):
            same = got[name] == ref
            print(
                f"{name:5} tokens {got[name]} {'==' if same else '!='} target's {ref}", flush=True
            )
            if not same:
                failures.append(f"{name} request: tokens differ from the target's greedy")
    for failure in failures:
        print(f"FAIL: {failure}", flush=True)
    print("long-prompt check: " + ("FAILED" if failures else "ok"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
