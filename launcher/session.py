"""Rank 0's two sessions: generate once (`tandem run`) and serve (`tandem serve`)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from launcher.bootstrap import Cluster, StartupUsageError, start_cluster
from launcher.discovery import LaunchEnv
from launcher.output import LastWords, RunOutput, flag_message, json_error, print_demo_header
from runtime.api.engine import OWNER_FD_ENV
from runtime.config import TandemConfig
from runtime.control.auth import load_key
from runtime.control.signals import ServerStop
from runtime.errors import EngineDeadError

if TYPE_CHECKING:  # imported where used: a `run` needs none of the serving endpoints
    from runtime.api.http.access import HttpAccess
    from runtime.api.http.app import HttpFront
    from runtime.serving.client_door import ClientDoor
    from runtime.serving.orchestrator import Orchestrator
    from runtime.serving.prometheus import MetricsEndpoint

log = logging.getLogger("tandem.launcher")
EXIT_DEAD = 1
EXIT_USAGE = 2
OWNER_GRACE_S = 5.0  # owner gone: how long an orderly shutdown may take before we just exit


def _start(
    config: TandemConfig, env: LaunchEnv, quiet: bool = False, orch: Orchestrator | None = None
) -> tuple[Orchestrator, Cluster] | int:
    """(orchestrator, cluster), or the exit code after printing why startup failed: 2 when
    the config asks for what a rank cannot hold (bootstrap.StartupUsageError), else 1;
    `quiet`: startup progress in plain lines (launcher.bootstrap.start_cluster). `orch`: an
    Orchestrator made already (`run`'s, which made its sequences first)."""
    from runtime.serving.orchestrator import Orchestrator

    if orch is None:
        orch = Orchestrator(config)  # loads the tokenizer while the workers load their shards
    try:
        return orch, start_cluster(config, env, quiet)
    except StartupUsageError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EngineDeadError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_DEAD


class _Interrupt:
    """SIGINT (Ctrl-C) and SIGTERM during `tandem run`. While starting, a signal raises
    KeyboardInterrupt: startup's waits end and its cleanup kills the workers. While
    generating it is only noted (`signum`): the loop stops after the current step, prints
    what was generated and shuts down in order, with no traceback from any rank. A second
    signal ends this process at once (its spawned workers die with it: PR_SET_PDEATHSIG),
    after `last_words` (--json's output: `timeout -s INT` signals twice, and a script still
    gets its JSON)."""

    def __init__(self):
        self.signum: int | None = None
        self.deferred = False
        self.last_words: LastWords | None = None
        self._previous: dict = {}

    def __enter__(self) -> _Interrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        if self.signum is not None:
            os.write(2, b"tandem: interrupted again; exiting now\n")
            if self.last_words is not None:
                self.last_words.exit_now(128 + signum)  # returns only into its own write
                return
            os._exit(128 + signum)
        self.signum = signum
        if not self.deferred:
            raise KeyboardInterrupt

    @property
    def code(self) -> int:
        """The shell's exit code for death by this signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + (self.signum or signal.SIGINT)

    def describe(self, what: str) -> str:
        return f"interrupted by {signal.Signals(self.signum or signal.SIGINT).name} {what}"

    def report(self, what: str) -> int:
        print(f"tandem: {self.describe(what)}", file=sys.stderr, flush=True)
        return self.code


def run_once(
    config: TandemConfig,
    env: LaunchEnv,
    request: dict,
    as_json: bool,
    quiet: bool = False,
    stream: bool = True,
) -> int:
    """Generate for the request's prompts and exit: 0, 1 (the engine died), 2 (a usage
    error), or 128 + the signal that interrupted it (130 for Ctrl-C)."""
    with _Interrupt() as interrupt:
        started = None
        if as_json:  # until the prompts are read, interrupted means an error object
            interrupt.last_words = json_error(lambda: interrupt.describe("while starting"))
        try:
            prepared = _prepare(config, request)
            if isinstance(prepared, int):
                return prepared
            orch, seqs = prepared
            out = RunOutput(seqs, as_json, stream)
            if as_json:  # from now on, one object per prompt with what it generated
                interrupt.last_words = out.json
            started = _start(config, env, quiet, orch)
            interrupt.deferred = True
        except KeyboardInterrupt:
            if isinstance(started, tuple):
                started[1].shutdown()
            if interrupt.last_words is not None:
                interrupt.last_words.write()
            return interrupt.report("while starting")
        if isinstance(started, int):
            return started
        orch, cluster = started
        try:
            return _generate(orch, cluster, seqs, out, request, interrupt)
        finally:
            cluster.shutdown()


def _prepare(config: TandemConfig, request: dict):
    """(orchestrator, sequences): the request tokenised and checked on rank 0 before any
    worker starts, so that a prompt that cannot fit (runtime.max_seq_len) is refused now,
    not once the workers have loaded; or exit code 2 after saying why."""
    from runtime.serving.orchestrator import Orchestrator

    orch = Orchestrator(config)
    try:
        return orch, orch.make_sequences(
            "run",
            request["prompts"],
            request["prompt_ids"],
            request["params"],
            chat=request["chat"],
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem: error: {flag_message(str(exc))}", file=sys.stderr)
        return EXIT_USAGE


def _generate(orch, cluster, seqs, out: RunOutput, request: dict, interrupt: _Interrupt) -> int:
    orch.attach(cluster.pool)
    out.profile = orch.profile
    if request.get("demo"):
        print_demo_header(request["prompts"])
    now = time.perf_counter()
    for seq in seqs:  # made before the workers started: their clock starts now
        seq.stats.t_start = now
    try:
        orch.submit(seqs)
        while interrupt.signum is None and not all(s.done for s in seqs):
            for event in orch.step():
                out.event(event)
    except EngineDeadError as exc:
        out.end_line()
        print(f"tandem: error: engine died: {exc}", file=sys.stderr)
        return EXIT_DEAD
    if interrupt.signum is not None:
        tokens = out.interrupted()
        return interrupt.report(f"after {tokens} generated token{'s' * (tokens != 1)}")
    out.finish()
    return 0


def serve_forever(
    config: TandemConfig,
    env: LaunchEnv,
    http: tuple[str, int] | None = None,
    metrics: tuple[str, int] | None = None,
    quiet: bool = False,
    served_model_name: str | None = None,
    address_source: str = "server.address",
    http_access: HttpAccess | None = None,
) -> int:
    """Serve at server.address until SIGINT/SIGTERM; with `http` = (host, port) also the
    OpenAI-compatible HTTP API (runtime/http_api.py) on a thread of this process, serving
    the model as `served_model_name` (default: the target's file or directory name), behind
    `http_access`'s key and TLS (runtime/api/http/access.py), with `metrics` = (host, port)
    the Prometheus metrics (runtime/serving/prometheus.py).
    Every address is bound before any worker starts: a taken one is a usage error (exit 2)
    naming its flag or key (`address_source` for server.address). SIGTERM drains (within
    server.shutdown_timeout_s), SIGINT or a second signal stops at once
    (runtime.control.signals.ServerStop)."""
    stop = ServerStop(drains=config.server.shutdown_timeout_s > 0)

    def on_signal(signum, _frame):  # the normal way to stop a server: no warning
        log.info("received signal %d; shutting down", signum)
        stop.on_signal(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        _watch_owner()
        bound = _Endpoints.bind(config, http, metrics, address_source)
        bound.http_access = http_access
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        started = _start(config, env, quiet)
        if isinstance(started, int):
            return started
        orch, cluster = started
        return _serve(config, orch, cluster, bound, served_model_name, stop)
    finally:
        bound.close()


@dataclass
class _Endpoints:
    """What `serve` listens on, bound before anything starts (closed by close())."""

    door: ClientDoor
    context: zmq.Context
    http_sock: socket.socket | None = None
    metrics: MetricsEndpoint | None = None
    front: HttpFront | None = None  # the HTTP front once started
    http_access: HttpAccess | None = None  # its key and TLS files

    @classmethod
    def bind(cls, config: TandemConfig, http, metrics, address_source: str) -> _Endpoints:
        """Bind server.address, then --http and --metrics; ValueError naming the one taken."""
        from runtime.serving.client_door import ClientDoor

        key = None if config.server.auth_key_file is None else load_key(config.server.auth_key_file)
        context = zmq.Context()
        try:
            door = ClientDoor(config.server.address, context, key)
        except zmq.ZMQError as exc:
            context.term()
            raise ValueError(
                f"{address_source}: cannot listen on {config.server.address}: {exc}"
            ) from None
        bound = cls(door, context)
        try:
            bound._bind_http(http, metrics)
        except BaseException:
            bound.close()
            raise
        return bound

    def _bind_http(self, http, metrics) -> None:
        if http is not None:
            from runtime.api.http.address import bind_http

            try:
                self.http_sock = bind_http(*http)
            except OSError as exc:
                raise ValueError(f"--http: cannot listen on {http[0]}:{http[1]}: {exc}") from None
        if metrics is not None:
            from runtime.serving.prometheus import MetricsEndpoint

            try:
                self.metrics = MetricsEndpoint(*metrics)
            except OSError as exc:
                raise ValueError(
                    f"--metrics: cannot listen on {metrics[0]}:{metrics[1]}: {exc}"
                ) from None

    def close(self) -> None:
        """The HTTP front first (its streams end with the failure replies), then the rest.
        Idempotent."""
        if self.front is not None:
            self.front.stop()
        elif self.http_sock is not None:
            self.http_sock.close()
        self.front = self.http_sock = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.door.close()
        if not self.context.closed:
            self.context.term()


def _serve(
    config: TandemConfig,
    orch,
    cluster,
    bound: _Endpoints,
    served_model_name: str | None,
    stop: ServerStop,
) -> int:
    """serve_forever once the workers are ready: serve until `stop`; the exit code."""
    from runtime.serving.server import Server

    code = 0
    try:
        server = Server(
            orch.attach(cluster.pool),
            bound.door,
            client_timeout_s=config.server.client_timeout_s,
            shutdown_timeout_s=config.server.shutdown_timeout_s,
        )
        print(f"tandem: serving at {config.server.address}", file=sys.stderr, flush=True)
        if bound.metrics is not None:
            bound.metrics.start(orch.metrics_registry())
            print(f"tandem: metrics at {bound.metrics.url}", file=sys.stderr, flush=True)
        if bound.http_sock is not None:
            from runtime.api.http.app import HttpFront

            bound.front = HttpFront(
                config.server.address,
                bound.http_sock,
                served_model_name,
                auth_key_file=config.server.auth_key_file,
                tokenizer_path=config.tokenizer_path,
                tool_parser=config.server.tool_parser,
                access=bound.http_access,
            )
            bound.front.start()
            print(f"tandem: HTTP API at {bound.front.url}", file=sys.stderr, flush=True)
        server.serve(stop.now, stop.drain)
    except EngineDeadError as exc:
        # the failure replies leave first: under MPICH's hydra a word on stderr after a rank
        # died can end every rank at once
        time.sleep(0.02)
        print(f"tandem: error: engine died: {exc}", file=sys.stderr)
        code = EXIT_DEAD
        time.sleep(0.2)  # let the failure replies leave
    finally:
        bound.close()  # every request answered before the workers are waited for
        cluster.shutdown()
    return code


def _watch_owner() -> None:
    """A server that Engine.launch started ends with the process that launched it, however
    that process ends: it gave us the read end of a pipe whose write end only it holds, so
    EOF there means it is gone (the OS closes a dead process's files, after SIGKILL too).
    Then it sends itself SIGTERM (which also ends the idle server's wait at once); a server
    still running OWNER_GRACE_S later (startup does not look at the signal) exits at once,
    and its workers die with it (PR_SET_PDEATHSIG).
    A `tandem serve` that a user started has no such pipe and serves until signalled."""
    value = os.environ.pop(OWNER_FD_ENV, None)  # our workers must not see it
    if value is None:
        return
    try:
        fd = int(value)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError("not a pipe")
    except (ValueError, OSError) as exc:
        raise ValueError(
            f"{OWNER_FD_ENV}: expected the file descriptor of a pipe "
            f"(set by Engine.launch), got {value!r}: {exc}"
        ) from None
    os.set_inheritable(fd, False)
    threading.Thread(target=_await_owner_end, args=(fd,), name="tandem-owner", daemon=True).start()


def _await_owner_end(fd: int) -> None:
    try:
        while os.read(fd, 512):  # the owner never writes: this returns at EOF only
            pass
    except OSError:
        pass
    os.close(fd)
    log.warning("the process that launched this server is gone; shutting down")
    os.kill(os.getpid(), signal.SIGTERM)  # as a user's SIGTERM: serve_forever's handler
    time.sleep(OWNER_GRACE_S)
    os._exit(EXIT_DEAD)
