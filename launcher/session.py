"""Rank 0's two sessions: generate once (`tandem run`) and serve (`tandem serve`)."""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time

from launcher.bootstrap import start_cluster
from launcher.discovery import LaunchEnv
from runtime.auth import load_key
from runtime.config import TandemConfig
from runtime.errors import EngineDeadError

log = logging.getLogger("tandem.launcher")
EXIT_DEAD = 1
EXIT_USAGE = 2


def _start(config: TandemConfig, env: LaunchEnv):
    """(orchestrator, cluster), or None after printing why startup failed."""
    from runtime.orchestrator import Orchestrator

    orch = Orchestrator(config)  # loads the tokenizer while the workers load their shards
    try:
        return orch, start_cluster(config, env)
    except EngineDeadError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return None


def run_once(config: TandemConfig, env: LaunchEnv, request: dict, as_json: bool) -> int:
    started = _start(config, env)
    if started is None:
        return EXIT_DEAD
    orch, cluster = started
    code = 0
    try:
        orch.attach(cluster.pool)
        seqs = orch.make_sequences("run", request["prompts"], request["prompt_ids"],
                                   request["params"], chat=request["chat"])
        for out in orch.run_until_done(seqs):
            if orch.scheduler.timing:
                out["stats"]["profile"] = orch.scheduler.profile()
            _print_output(out, as_json)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except EngineDeadError as exc:
        print(f"tandem: error: engine died: {exc}", file=sys.stderr)
        code = EXIT_DEAD
    finally:
        cluster.shutdown()
    return code


def serve_forever(config: TandemConfig, env: LaunchEnv) -> int:
    from runtime.server import Server

    stop = threading.Event()

    def on_signal(signum, _frame):
        log.warning("received signal %d; shutting down", signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    started = _start(config, env)
    if started is None:
        return EXIT_DEAD
    orch, cluster = started
    server = None
    code = 0
    try:
        key = None if config.server.auth_key_file is None else \
            load_key(config.server.auth_key_file)
        server = Server(orch.attach(cluster.pool), config.server.address, cluster.context, key)
        print(f"tandem: serving at {config.server.address}", file=sys.stderr, flush=True)
        server.serve(stop)
    except EngineDeadError as exc:
        print(f"tandem: error: engine died: {exc}", file=sys.stderr)
        code = EXIT_DEAD
        time.sleep(0.2)  # let the failure replies leave
    finally:
        if server is not None:
            server.close()
        cluster.shutdown()
    return code


def _print_output(out: dict, as_json: bool) -> None:
    out = dict(out)
    out.pop("index")
    if as_json:
        print(json.dumps(out), flush=True)
        return
    print(out["text"], flush=True)
    s = out["stats"]
    print(f"[{len(out['token_ids'])} tokens, finish={out['finish_reason']}, "
          f"acceptance={s['acceptance_rate']:.2f}, "
          f"tokens/round={s['mean_accepted_tokens']:.2f}, "
          f"{s['tokens_per_s']:.1f} tokens/s]", file=sys.stderr)
