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
from runtime.control.auth import load_key
from runtime.config import TandemConfig
from runtime.errors import EngineDeadError

log = logging.getLogger("tandem.launcher")
EXIT_DEAD = 1
EXIT_USAGE = 2


def _start(config: TandemConfig, env: LaunchEnv):
    """(orchestrator, cluster), or None after printing why startup failed."""
    from runtime.serving.orchestrator import Orchestrator

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
            profile = orch.profile()
            if profile:
                out["stats"]["profile"] = profile
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


def serve_forever(config: TandemConfig, env: LaunchEnv,
                  http: tuple[str, int] | None = None) -> int:
    """Serve at server.address until SIGINT/SIGTERM; with `http` = (host, port) also the
    OpenAI-compatible HTTP API (runtime/http_api.py) on a thread of this process."""
    from runtime.serving.server import Server

    stop = threading.Event()
    http_sock = None
    if http is not None:
        from runtime.api.http_api import bind_http

        try:  # bound before anything starts: a taken port is a usage error
            http_sock = bind_http(*http)
        except OSError as exc:
            print(f"tandem: error: --http: cannot listen on {http[0]}:{http[1]}: {exc}",
                  file=sys.stderr)
            return EXIT_USAGE

    def on_signal(signum, _frame):
        log.warning("received signal %d; shutting down", signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    started = _start(config, env)
    if started is None:
        if http_sock is not None:
            http_sock.close()
        return EXIT_DEAD
    orch, cluster = started
    server = front = None
    code = 0
    try:
        key = None if config.server.auth_key_file is None else \
            load_key(config.server.auth_key_file)
        server = Server(orch.attach(cluster.pool), config.server.address, cluster.context, key)
        print(f"tandem: serving at {config.server.address}", file=sys.stderr, flush=True)
        if http_sock is not None:
            from runtime.api.http_api import HttpFront

            front = HttpFront(config.server.address, http_sock,
                              auth_key_file=config.server.auth_key_file)
            front.start()
            print(f"tandem: HTTP API at {front.url}", file=sys.stderr, flush=True)
        server.serve(stop)
    except EngineDeadError as exc:
        # the failure replies leave first: under MPICH's hydra a word on stderr after a rank
        # died can end every rank at once
        time.sleep(0.02)
        print(f"tandem: error: engine died: {exc}", file=sys.stderr)
        code = EXIT_DEAD
        time.sleep(0.2)  # let the failure replies leave
    finally:
        if front is not None:
            front.stop()  # serve() failed its requests: the streams end, then it stops
        elif http_sock is not None:
            http_sock.close()
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
