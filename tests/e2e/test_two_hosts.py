"""Two hosts for real: two network namespaces joined by a veth pair (private addresses), each
with its own host name, and one torchrun agent in each (`--nnodes 2`, static rendezvous on
the first one's address). Namespace 1 runs the orchestrator (rank 0, `tandem serve`) and the
draft (cpu:0, node 0); namespace 2 a TP-2 target (n1:cpu:0, n1:cpu:1: CPU slots of node 1). The
control plane binds to namespace 1's address and is signed (TANDEM_AUTH_KEY_FILE); gloo
talks over the veth (GLOO_SOCKET_IFNAME). Clients run in namespace 1.

Two jobs: the first checks greedy output against transformers through a client, that an
unsigned frame from namespace 2 to rank 0's control sockets is dropped (logged and counted), and
that SIGKILL to namespace 2's torchrun agent takes its ranks with it (launcher/orphan.py)
and then the whole job; the second that a killed target rank raises EngineDeadError at the
client within 10 s and every rank exits. Root only; every process (tagged by an environment
variable) and both namespaces are removed afterwards, whatever happened."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import checkpoints, launch
from tests.processes import kill_all, ranks_of, read, socket_inodes, wait_gone

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 2, 33]]
NEW_TOKENS = 16
TAG = "TANDEM_TWO_HOSTS_RUN"  # set on every process of this test: the cleanup's net

# a client in namespace 1: "generate" prints the token ids of PROMPTS; "stream" prints
# "streaming" once a long request runs, then how its end came as JSON
CLIENT = """
import json, sys, time
from runtime import Client, EngineDeadError
address, mode, prompts, new = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
client = Client(address, dead_after_s=120)
deadline = time.monotonic() + 120
while True:
    try:
        client.info(timeout_s=2); break
    except EngineDeadError:
        if time.monotonic() > deadline: raise
client.dead_after_s = 10.0
if mode == "generate":
    outs = client.generate(prompt_token_ids=prompts, max_new_tokens=new)
    print(json.dumps([o.token_ids for o in outs]), flush=True)
elif mode == "metrics":
    print(json.dumps(client.metrics()), flush=True)
else:
    stream = client.stream(prompt_token_ids=prompts[0], max_new_tokens=new)
    next(stream); next(stream)
    print("streaming", flush=True)
    start = time.monotonic()
    try:
        for _ in stream: pass
        print(json.dumps({"error": None}), flush=True)
    except EngineDeadError as exc:
        print(json.dumps({"error": str(exc), "after_s": time.monotonic() - start}), flush=True)
client.close()
"""

# from namespace 2: an unsigned frame to each given port of rank 0's address
STRANGER = """
import sys, time, zmq
ctx = zmq.Context()
for port in sys.argv[2:]:
    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 2000)
    s.connect(f"tcp://{sys.argv[1]}:{port}"); s.send(b'{"type": "hello", "rank": 1}')
time.sleep(1.0)
ctx.destroy(linger=2000)
"""


@dataclass
class Host:
    ns: str
    addr: str
    ifname: str
    hostname: str

    def command(self, argv: list[str]) -> list[str]:
        """argv run in this namespace under its own host name (the pid stays argv's)."""
        return [
            "ip",
            "netns",
            "exec",
            self.ns,
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostname,
            *argv,
        ]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def _tagged(tag: str) -> set[int]:
    """Every process whose environment holds TAG=tag."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if f"{TAG}={tag}".encode() in fh.read().split(b"\0"):
                    found.add(int(entry))
        except (OSError, ValueError):
            pass
    return found


@pytest.fixture(scope="module")
def hosts():
    """Two namespaces joined by a veth pair; afterwards every tagged process is killed and
    the namespaces (their ends of the veth with them) deleted."""
    if os.geteuid() != 0:
        pytest.skip("needs root: it makes network namespaces")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("needs `ip` (iproute2) and `unshare` (util-linux)")
    run = f"{os.getpid() % 100000}"
    net = f"10.213.{os.getpid() % 250 + 1}"
    pair = [Host(f"tandem{run}n{i}", f"{net}.{i}", f"tdm{run}v{i}", f"tandem-n{i}") for i in (1, 2)]
    tag = secrets.token_hex(8)
    try:
        _setup(pair)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        _teardown(pair, tag)
        pytest.skip(f"ip netns unavailable: {getattr(exc, 'stderr', b'') or exc}")
    try:
        yield pair, tag
    finally:
        _teardown(pair, tag)


def _setup(pair: list[Host]) -> None:
    a, b = pair
    for host in pair:
        _ip("netns", "add", host.ns)
    _ip("link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
    for host in pair:
        _ip("link", "set", host.ifname, "netns", host.ns)
        _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
        _ip("-n", host.ns, "link", "set", host.ifname, "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")


def _teardown(pair: list[Host], tag: str) -> None:
    kill_all(_tagged(tag))
    wait_gone(_tagged(tag), 10)
    for host in pair:
        subprocess.run(["ip", "netns", "del", host.ns], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", host.ifname], capture_output=True, timeout=20)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(host.ns in names for host in pair), names


@pytest.fixture(scope="module")
def setup(hosts, tmp_path_factory):
    """(hosts, tag, config path, env, reference token ids)."""
    pair, tag = hosts
    root = tmp_path_factory.mktemp("two-hosts")
    # no EOS: a long request surely runs when a rank is killed
    target = checkpoints.build_checkpoint(
        root / "target", "llama", seed=0, eos_token_id=None, max_position_embeddings=2048
    )
    draft = checkpoints.build_near_draft(target, root / "draft", noise=0.05)
    cfg = launch.write_config(
        root / "c.yaml",
        draft,
        target,
        ["cpu:0"],
        ["n1:cpu:0", "n1:cpu:1"],
        draft_len=3,
        max_seq_len=2048,
    )
    key = root / "key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    env = dict(
        launch.clean_env(),
        TANDEM_AUTH_KEY_FILE=str(key),
        PYTHONPATH=str(ROOT),
        TANDEM_CONTROL_HOST=pair[0].addr,
        **{TAG: tag},
    )
    reference = checkpoints.GreedyReference({"target": target}, PROMPTS, NEW_TOKENS)
    return pair, cfg, env, reference("target"), root


class Job:
    """`tandem serve` under two torchrun agents, one per namespace, each in its own session
    with its output in a file; rank 0 serves at 127.0.0.1 of namespace 1."""

    def __init__(self, setup, name: str):
        self.pair, cfg, self.env, _, root = setup
        self.err = [root / f"{name}-n{i}.txt" for i in (1, 2)]
        master, serve = launch.free_port(), launch.free_port()
        self.address = f"tcp://127.0.0.1:{serve}"
        self.agents = []
        for node, host in enumerate(self.pair):
            argv = [
                sys.executable,
                str(launch.BIN / "torchrun"),
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=2",
                f"--master-addr={self.pair[0].addr}",
                f"--master-port={master}",
                "-m",
                "launcher",
                "serve",
                cfg,
                "--address",
                self.address,
            ]
            with open(self.err[node], "w") as out:
                self.agents.append(
                    subprocess.Popen(
                        host.command(argv),
                        stdout=out,
                        stderr=out,
                        start_new_session=True,
                        env=dict(self.env, GLOO_SOCKET_IFNAME=host.ifname),
                    )
                )
        self.ranks: dict[int, int] = {}

    def client(self, mode: str, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> subprocess.Popen:
        argv = [
            sys.executable,
            "-c",
            CLIENT,
            self.address,
            mode,
            json.dumps(prompts),
            str(new_tokens),
        ]
        return subprocess.Popen(
            self.pair[0].command(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )

    def find_ranks(self) -> dict[int, int]:
        for agent in self.agents:
            self.ranks.update(ranks_of(agent.pid, 2))
        assert sorted(self.ranks) == [0, 1, 2, 3], self.ranks
        return self.ranks

    def stderr(self) -> str:
        return "\n".join(
            f"--- namespace {i + 1}:\n{read(p)[-3000:]}" for i, p in enumerate(self.err)
        )

    def wait_all_gone(self, timeout_s: float) -> None:
        for agent in self.agents:
            try:
                agent.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"an agent still runs:\n{self.stderr()}") from None
        wait_gone(self.ranks.values(), timeout_s)


def _line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next line of proc's stdout; AssertionError after timeout_s."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            proc.kill()
            raise AssertionError(f"no output within {timeout_s} s: {proc.stderr.read()}")
    return proc.stdout.readline().strip()


def _streaming(job: Job) -> subprocess.Popen:
    """A client in namespace 1 with a long request running."""
    client = job.client("stream", new_tokens=1500)
    line = _line(client, 150)
    assert line == "streaming", (line, client.stderr.read(), job.stderr())
    return client


def _ended(client: subprocess.Popen) -> dict:
    out = json.loads(_line(client, 30))
    client.wait(10)
    return out


def _listening_ports(pid: int, addr: str) -> list[int]:
    """The TCP ports process `pid` listens on at IPv4 address `addr` (its namespace's view)."""
    inodes = socket_inodes(pid)
    want = "".join(f"{int(part):02X}" for part in reversed(addr.split(".")))
    ports = []
    for row in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and inode in inodes and local.split(":")[0] == want:
            ports.append(int(local.split(":")[1], 16))
    return ports


@pytest.fixture(scope="module")
def job(setup):
    job = Job(setup, "a")
    try:
        yield job
    finally:
        kill_all(_tagged(setup_tag(setup)) - {os.getpid()})


def setup_tag(setup) -> str:
    return setup[2][TAG]


def test_greedy_output_through_a_client_on_host_1(job, setup):
    client = job.client("generate")
    out = _line(client, 150)
    client.wait(10)
    assert json.loads(out) == setup[3], (out, job.stderr())
    job.find_ranks()


def test_unsigned_frame_from_host_2_is_dropped(job):
    ports = _listening_ports(job.ranks[0], job.pair[0].addr)
    assert len(ports) >= 2, ports  # the control and heartbeat sockets (and the beacon)
    stranger = subprocess.run(
        job.pair[1].command([sys.executable, "-c", STRANGER, job.pair[0].addr, *map(str, ports)]),
        capture_output=True,
        text=True,
        timeout=60,
        env=job.env,
    )
    assert stranger.returncode == 0, stranger.stderr
    deadline = time.monotonic() + 10
    while "frame signature does not match" not in read(job.err[0]):
        assert time.monotonic() < deadline, job.stderr()
        time.sleep(0.2)
    assert "dropped a worker frame" in read(job.err[0]) or "dropped a heartbeat frame" in read(
        job.err[0]
    )
    client = job.client("metrics")  # and counted, as Prometheus shows
    text = json.loads(_line(client, 60))
    client.wait(10)
    dropped = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("tandem:control_frames_dropped_total ")
    ]
    assert dropped and dropped[0] >= 1, text


def test_killed_agent_takes_its_ranks_and_the_job_down(job):
    """SIGKILL to namespace 2's torchrun agent: its ranks exit at once (launcher/orphan.py);
    rank 0 then sees dead ranks, fails the client's request and every rank exits."""
    client = _streaming(job)
    job.agents[1].kill()
    took = wait_gone([job.ranks[2], job.ranks[3]], 5)
    print(f"ranks of the killed agent gone after {took:.2f} s")
    ended = _ended(client)
    assert ended["error"] is not None and ended["after_s"] < 10, ended
    job.wait_all_gone(30)


def test_killed_target_rank_is_an_engine_dead_error_on_host_1(setup):
    job = Job(setup, "b")
    try:
        client = _streaming(job)
        job.find_ranks()
        os.kill(job.ranks[2], signal.SIGKILL)
        ended = _ended(client)
        assert ended["error"] is not None and ended["after_s"] < 10, (ended, job.stderr())
        job.wait_all_gone(30)
    finally:
        kill_all(_tagged(setup_tag(setup)) - {os.getpid()})
