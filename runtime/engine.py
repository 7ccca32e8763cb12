"""Engine.launch: start orchestrator + workers (`tandem serve` in a child process) and hand
back a Client connected to it. The config is validated here first, so a bad config raises
ConfigError before any process starts."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import yaml

from runtime.client import Client
from runtime.config import TandemConfig, load_config
from runtime.errors import EngineDeadError


class Engine(Client):
    def __init__(self, address: str, process: subprocess.Popen, tmpdir: str, **kwargs):
        self._process = process
        self._tmpdir = tmpdir
        super().__init__(address, **kwargs)

    @classmethod
    def launch(cls, config: str | os.PathLike | dict | TandemConfig,
               startup_timeout_s: float | None = None) -> "Engine":
        cfg = config if isinstance(config, TandemConfig) else load_config(config)
        tmpdir = tempfile.mkdtemp(prefix="tandem-")
        path = os.path.join(tmpdir, "config.yaml")
        with open(path, "w") as fh:
            yaml.safe_dump(cfg.to_dict(), fh)
        address = f"ipc://{tmpdir}/server.sock"
        cmd = [sys.executable, "-m", "launcher", "serve", path, "--address", address]
        env = dict(os.environ, TANDEM_LAUNCH="spawn")
        process = subprocess.Popen(cmd, start_new_session=True, env=env)
        engine = cls(address, process, tmpdir)
        timeout = startup_timeout_s or cfg.runtime.startup_timeout_s
        try:
            engine.info(timeout_s=timeout)
        except BaseException:
            engine.close()
            raise
        return engine

    def _process_gone(self) -> str | None:
        code = self._process.poll()
        if code is None:
            return None
        return f"tandem server (pid {self._process.pid}) exited with code {code}"

    def info(self, timeout_s: float = 30.0) -> dict:
        try:
            return super().info(timeout_s)
        except EngineDeadError:
            reason = self._process_gone()
            if reason:
                raise EngineDeadError(reason) from None
            raise

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s) and everything it started."""
        super().close()
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
