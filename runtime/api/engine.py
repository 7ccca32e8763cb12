"""Engine.launch: start orchestrator + workers (`tandem serve` in a child process) and hand
back a Client connected to it. The config is validated here first, so a bad config raises
ConfigError before any process starts. The server's stderr passes through a thread of ours
to our stderr; when the server exits, EngineDeadError carries its last error line.

The launching process owns the server. close() stops it, and so does the Engine's
finalizer when the Engine is collected or still open at exit. However else this process
ends (a signal, SIGKILL), the server ends with it: it holds the read end of a pipe whose
write end only this process holds, and takes EOF there for its owner's end
(launcher/session.py); its workers die with it."""

from __future__ import annotations

import collections
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import yaml

from runtime.api.client import Client
from runtime.config import TandemConfig, load_config
from runtime.errors import EngineClosedError, EngineDeadError

ERROR_PREFIX = "tandem: error: "
# lines of the server that say nothing to the Engine's user (the address is the Engine's
# own business), forwarded only when TANDEM_LOG asks for detail
INTERNAL_PREFIXES = ("tandem: serving at ",)
TAIL_LINES = 20
MAX_DETAIL_CHARS = 2000
OWNER_FD_ENV = "TANDEM_OWNER_FD"  # tells the server its end of the owner pipe (session.py)
STOP_WAIT_S = 30.0  # close(): how long the server gets after SIGTERM

# The write ends of the owner pipes of the servers this process launched. A forked child
# closes its copies at once: the servers end with their owner, not with its last child.
_OWNER_FDS: set[int] = set()


def _close_owner_fds_in_child() -> None:
    for fd in _OWNER_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _OWNER_FDS.clear()


os.register_at_fork(after_in_child=_close_owner_fds_in_child)


def _stop_server(
    process: subprocess.Popen, tmpdir: str, owner_fd: int | None, owner_pid: int
) -> None:
    """The Engine's part of close() (after the Client's): end the server (SIGTERM, then
    SIGKILL of its process group after STOP_WAIT_S) and everything it started. Holds no
    reference to the Engine (its finalizer calls this). Only the launching process stops
    it: a forked child's copy of the Engine leaves it to its owner."""
    if os.getpid() != owner_pid:
        return
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if owner_fd is not None:  # only now: the owner pipe's end would cut the shutdown short
        _OWNER_FDS.discard(owner_fd)
        os.close(owner_fd)
    shutil.rmtree(tmpdir, ignore_errors=True)


class StderrTail:
    """Forwards a child's stderr pipe to our stderr line by line (on a daemon thread), but
    for its INTERNAL_PREFIXES lines, and keeps its last lines, so that the child's own
    account of a failure can be reported."""

    def __init__(self, pipe, forward=None):
        self._pipe = pipe
        self._forward = forward
        self._internal = (
            ()
            if os.environ.get("TANDEM_LOG", "").upper() in ("DEBUG", "INFO")
            else INTERNAL_PREFIXES
        )
        self.lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="tandem-stderr", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._pipe:
            for raw in iter(self._pipe.readline, b""):
                line = raw.decode(errors="replace")
                if not line.startswith(self._internal):
                    self._write(line)
                text = line.strip()
                if text.startswith(ERROR_PREFIX):
                    self.last_error = text[len(ERROR_PREFIX) :]
                if text:
                    self.lines.append(text)

    def _write(self, line: str) -> None:
        out = self._forward or sys.stderr
        if out is None:
            return
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError):  # our stderr is closed: keep reading, stop writing
            self._forward = _Discard()

    def detail(self, wait_s: float = 2.0) -> str | None:
        """The child's last "tandem: error:" line, else its last line (e.g. a traceback's
        exception); waits up to wait_s for the pipe to close (every writer gone)."""
        self._thread.join(wait_s)
        text = self.last_error or (self.lines[-1] if self.lines else None)
        return None if text is None else text[:MAX_DETAIL_CHARS]


class _Discard:
    def write(self, _text: str) -> None:
        pass

    def flush(self) -> None:
        pass


class Engine(Client):
    NAME = "engine"

    def __init__(
        self,
        address: str,
        process: subprocess.Popen,
        tmpdir: str,
        stderr: StderrTail | None = None,
        owner_fd: int | None = None,
        **kwargs,
    ):
        self._process = process
        self._tmpdir = tmpdir
        self._stderr = stderr
        self._gone: str | None = None
        try:
            super().__init__(address, **kwargs)
        except BaseException:
            _stop_server(process, tmpdir, owner_fd, os.getpid())
            raise
        self._closers.append(
            functools.partial(_stop_server, process, tmpdir, owner_fd, os.getpid())
        )

    @classmethod
    def launch(
        cls, config: str | os.PathLike | dict | TandemConfig, startup_timeout_s: float | None = None
    ) -> Engine:
        cfg = config if isinstance(config, TandemConfig) else load_config(config)
        tmpdir = tempfile.mkdtemp(prefix="tandem-")
        path = os.path.join(tmpdir, "config.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(cfg.to_dict(), fh)
        address = f"ipc://{tmpdir}/server.sock"
        # no drain: close() stops the server at once (its requests fail), as it always did
        cmd = [sys.executable, "-m", "launcher", "serve", path, "--address", address]
        cmd += ["--shutdown-timeout", "0"]
        # the server's end of the owner pipe; ours stays here (not inheritable) and closes
        # when this process ends, or at close()
        owner_r, owner_w = os.pipe()
        env = dict(os.environ, TANDEM_LAUNCH="spawn", **{OWNER_FD_ENV: str(owner_r)})
        try:
            process = subprocess.Popen(
                cmd, start_new_session=True, env=env, stderr=subprocess.PIPE, pass_fds=(owner_r,)
            )
        except BaseException:
            os.close(owner_w)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        finally:
            os.close(owner_r)
        _OWNER_FDS.add(owner_w)
        engine = cls(address, process, tmpdir, StderrTail(process.stderr), owner_fd=owner_w)
        timeout = startup_timeout_s or cfg.runtime.startup_timeout_s
        running_dead_after_s, engine.dead_after_s = engine.dead_after_s, timeout
        try:
            # the server answers once its workers have loaded (and captured their CUDA
            # graphs), which may take longer than the silence allowed later on; a server
            # process that exits still fails this at once
            engine.info(timeout_s=timeout)
        except BaseException:
            engine.close()
            raise
        engine.dead_after_s = running_dead_after_s
        return engine

    def _process_gone(self) -> str | None:
        """Why the server is gone (its exit code and last error line); None while it runs."""
        if self._gone is None:
            code = self._process.poll()
            if code is None:
                return None
            reason = f"tandem server (pid {self._process.pid}) exited with code {code}"
            detail = self._stderr.detail() if self._stderr is not None else None
            self._gone = f"{reason}: {detail}" if detail else reason
        return self._gone

    def info(self, timeout_s: float | None = 30.0) -> dict:
        try:
            return super().info(timeout_s)
        except EngineClosedError:
            raise
        except EngineDeadError:
            reason = self._process_gone()
            if reason:
                raise EngineDeadError(reason) from None
            raise

    def close(self) -> None:
        """Every waiting call raises EngineClosedError at once (Client.close), then the
        server is stopped (SIGTERM, then SIGKILL after STOP_WAIT_S) with everything it
        started. Idempotent; runs by itself when the Engine is collected or the
        interpreter exits."""
        super().close()
