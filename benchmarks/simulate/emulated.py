"""An emulated multi-node cluster on this one machine, for checking a simulator of dsgd's step.

    sudo python benchmarks/simulate/emulated.py [--nodes 2 4 8] [--steps 8] [--rounds 2] [--warmup 2]
        [--link-mbit M | --aggregate-mbit 640] [--latency-ms 0] [--store-mib 512]
        [--models flat sleepy] [--layouts explicit|default|both] [--ring [--no-dsgd]]
        [--out benchmarks/results/emulated.json]
    sudo python benchmarks/simulate/emulated.py --cleanup    # leftovers of a crashed run

`--ring` also runs Horovod's ring allreduce (Gloo) on the same nodes and links
(emulated_ring.py; build Horovod first with benchmarks/peers/setup_horovod.sh).

Needs root, `ip` and `tc` (iproute2), network namespaces, veth, bridge and htb;
netem only for latency_ms > 0. THIS machine's kernel has no netem (nor fq, so no
EDT-based delay either: CONFIG_NET_SCH_NETEM is not set), so here the links are
shaped in rate only and --latency-ms defaults to 0 (a value > 0 fails with a
clear error); the veth path's own round trip is ~0.02 ms (measured, `rtt_ms`).

The network. A Linux bridge `dsgdbr0` (10.78.0.1/16) in the root namespace; per
worker node i a network namespace `dsgd-n{i}` joined to the bridge by a veth pair
(`dsgdh{i}` on the bridge, `dsgdn{i}` in the namespace with 10.78.1.{i+1}/16, `lo`
up there). Each node's link is shaped per direction with tc: egress of `dsgdn{i}`
is the node's uplink, egress of `dsgdh{i}` its downlink; each is an htb class at
`link_mbit` (burst max(128 KiB, 2 ms at the rate), larger than a 64 KiB GSO
packet, so bulk transfers reach the rate) with a netem leaf delaying
`latency_ms / 2` (a pfifo leaf when latency_ms is 0). So node -> node one way
crosses two shaped qdiscs (sender's uplink, receiver's downlink) and gets
`latency_ms` added, a round trip 2 x latency_ms; head <-> node gets half of that.
Every node is full duplex: `link_mbit` up and `link_mbit` down at once. The
bridge itself (and the head's side, root namespace) is not shaped: it is the
ideal switch. Measured on start: single-stream TCP throughput node 0 -> node 1,
both directions at once, and a 1-byte ping-pong round trip (`link` in the JSON).
htb counts whole frames: TCP payload gets 1448/1514 = 95.6% of the shaped rate
(measured: 287 Mbit/s payload at 300, 153 at 160), and the tc byte counters in the
JSON are frame bytes, so `link_floor_s` (busiest direction's bytes / rate) is the
step's network lower bound.

The Ray cluster. `ray.cluster_utils.Cluster`: the head in the root namespace on
10.78.0.1 with num_cpus=0 (the driver runs there, no worker lands there), then
one node per namespace with num_cpus=1: the calling thread enters the namespace
(ctypes `setns(fd, CLONE_NEWNET)` on /var/run/netns/dsgd-n{i}; Python 3.11 has no
os.setns) before `cluster.add_node(node_ip_address=10.78.1.{i+1}, ...)`, so its
raylet, object store and every worker it starts are born inside that namespace,
and the thread switches back to the saved root namespace in a `finally`. Traffic
between two nodes' object managers therefore crosses both nodes' shaped veths
(checked per run: the htb byte counters of every node's uplink and downlink,
before and after the measured steps, `tc_bytes` in the JSON); traffic between a
worker and its own node's raylet stays on that namespace's `lo`.

All nodes share this host's cores (2 here) and memory: the link must be slow
enough that the network, not the CPUs, bounds the step (`cpu_busy` in the JSON:
the fraction of all cores busy during the measured steps, the whole machine's).
Ray transfers between the namespaces cost ~150 MiB/s of uplink traffic (all nodes
together) at both cores saturated (8 nodes at 300 Mbit/s: 91% busy, step 2 x the
link floor), so by default the links of N nodes add up to a fixed 640 Mbit/s
(320 / 160 / 80 Mbit/s per node for 2 / 4 / 8 nodes).

Per-step times: under the workers' own exchange (dsgd's default) one actor call
runs up to max(8, 4 x N) steps and train() gives each of them the call's mean, so
`step_times` (one list per measured train() call) are per-call means, and `step_s`
is the median over the `--rounds` train() calls of their median.

`run_dsgd` runs the real engine on it: `dsgd.DistributedSGD(num_workers=num_nodes,
devices_per_worker=1, gpu=False)`: one CPU per node, so one worker per node, and the
PS actors wherever dsgd's own placement puts them. Two models, imported from
benchmarks/scaling_check.py (`FlatModel`, compute-free) and benchmarks/overlap.py
(`SleepyModel`, 4 MiB layers whose compute is a sleep).

On exit (also on exceptions, Ctrl-C, SIGTERM in the CLI, and atexit) Ray is shut
down and every namespace, veth and the bridge is removed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import functools
import glob
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Self

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
REPO = os.path.dirname(BENCHMARKS)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MIB = 2**20
PREFIX = "dsgd"
BRIDGE = "dsgdbr0"
HEAD_IP = "10.78.0.1"
CLONE_NEWNET = 0x40000000
THROUGHPUT_PORT = 47800

# Ray knobs for many nodes on few cores: slow start-ups are not failures.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "RAY_worker_register_timeout_seconds": "300",
    "RAY_health_check_failure_threshold": "30",
    "RAY_health_check_timeout_ms": "30000",
    # Ray's own SIGTERM handler (ray._private.node) would first drain the node.
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    # The object manager retries a pull, and gives up a chunk push, after 10 s
    # (ray_config_def.h object_manager_pull_timeout_ms / _push_timeout_ms). These
    # links are 100-300x slower than a cluster's, the gradients not smaller: a 5 MiB
    # chunk among a PS node's dozen concurrent transfers at 80 Mbit/s can take longer
    # than that, and retried transfers then resend bytes and stall whole steps (seen:
    # 60+ s steps and a StepTimeoutError at 8 nodes), which at 25 Gb/s would take a
    # thousand-way fan-in. The timers are scaled with the rate, as the bytes are not.
    "RAY_object_manager_pull_timeout_ms": "600000",
    "RAY_object_manager_push_timeout_ms": "600000",
    # The object manager's RPC threads and connections (ray_config_def.h; by default
    # min(max(2, CPUs/4), 8) threads, 2 on these nodes, and 4 connections). With them, on
    # these links, transfers of objects of more than one 5 MiB chunk in opposite
    # directions took turns: the 2-node after-backward run (two 8 MiB objects crossing)
    # measured 1.28-1.42x the simulation in four runs; with 8 of each, or with 16 MiB
    # chunks, 1.07 and 1.08x (2026-11-27). A chunk spends ~140 ms on a 300 Mbit/s link
    # against ~2 ms at 25 Gb/s: what holds the object manager for one chunk is 80-300x
    # longer here than on a cluster, so it gets a cluster node's thread count.
    "RAY_object_manager_rpc_threads_num": "8",
    "RAY_object_manager_client_connection_num": "8",
}
# Every process the cluster starts inherits this (--cleanup finds a crashed run's by it,
# where setproctitle has not overwritten the environment).
MARKER = "DSGD_EMULATED_CLUSTER"
# The running cluster's Ray session directory (--cleanup kills whatever has files open
# there: the head's processes live in the root namespace).
STATE_FILE = "/tmp/dsgd-emulated-cluster.json"


def netns_name(i: int) -> str:
    return f"{PREFIX}-n{i}"


def node_ip(i: int) -> str:
    return f"10.78.1.{i + 1}"


def host_veth(i: int) -> str:
    return f"{PREFIX}h{i}"


def ns_veth(i: int) -> str:
    return f"{PREFIX}n{i}"


# -- namespaces ---------------------------------------------------------------------

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(name: str):
    """The calling thread (only it) in network namespace `name` for the block:
    sockets it opens and processes it starts live there."""
    root = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(root)
        finally:
            os.close(target)
    finally:
        os.close(root)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def check_prerequisites() -> None:
    """Clear errors for what this needs: root, `ip` and `tc`, /var/run/netns."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"emulated cluster needs {' and '.join(missing)} (iproute2) on PATH; "
                           "install iproute2")
    if os.geteuid() != 0:
        raise PermissionError("emulated cluster needs root (network namespaces, veth, bridge, "
                              "tc); run it with sudo")
    if not os.path.exists("/proc/thread-self/ns/net"):
        raise RuntimeError("no /proc/thread-self/ns/net: this kernel has no network namespaces")


def _tc_bytes(dev: str, ns: str | None) -> int:
    """Bytes sent through `dev`'s root qdisc (its egress)."""
    cmd = ["tc"] + (["-n", ns] if ns else []) + ["-s", "-j", "qdisc", "show", "dev", dev]
    for q in json.loads(_run(*cmd).stdout or "[]"):
        if q.get("root"):
            return int(q["bytes"])
    return 0


def _shape(dev: str, ns: str | None, mbit: float, delay_ms: float) -> None:
    """`dev`'s egress at `mbit`: an htb class at the rate, split in two leaves that
    borrow from each other: packets under 128 bytes (TCP's pure ACKs, Ray's small
    control messages) first, the rest behind them, each queue 1,000 packets (a
    NIC's txqueuelen). Without the split, the ACKs of a transfer coming in wait
    behind a full queue of data going out on the same link, and a node that
    sends and receives at once (every dsgd node does) gets far less than the
    rate: measured 49 of 80 Mbit/s both ways with one deep FIFO."""
    tc = ["tc"] + (["-n", ns] if ns else [])
    rate_bytes = mbit * 1e6 / 8
    burst = max(128 * 1024, int(rate_bytes * 0.002))
    _run(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
         "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", "burst", str(burst), "cburst", str(burst),
         "quantum", "200000")
    for leaf, share, prio in ((10, 0.05, 0), (20, 0.95, 1)):
        _run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", f"1:{leaf}", "htb",
             "rate", f"{mbit * share}mbit", "ceil", f"{mbit}mbit", "burst", str(burst),
             "cburst", str(burst), "prio", str(prio), "quantum", "200000")
        if delay_ms > 0:
            proc = _run(*tc, "qdisc", "add", "dev", dev, "parent", f"1:{leaf}", "handle",
                        f"{leaf}:", "netem", "delay", f"{delay_ms}ms", "limit", "1000",
                        check=False)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"cannot add a netem delay on {dev} ({proc.stderr.strip()}): this kernel "
                    "may lack CONFIG_NET_SCH_NETEM (grep NETEM /proc/config.gz); run with "
                    "latency_ms=0 (--latency-ms 0): the links are then shaped in rate only")
        else:
            _run(*tc, "qdisc", "add", "dev", dev, "parent", f"1:{leaf}", "handle", f"{leaf}:",
                 "pfifo", "limit", "1000")
    # IPv4 total length (bytes 2-3 of the header) under 128: the small-packet leaf.
    _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
         "u32", "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10")


def _our_netns() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.split() and line.split()[0].startswith(PREFIX + "-")]


def _our_links() -> list[str]:
    out = _run("ip", "-j", "link", "show", check=False).stdout or "[]"
    return [link["ifname"] for link in json.loads(out) if link["ifname"].startswith(PREFIX)]


def _kill_netns_processes(ns: str) -> list[int]:
    """SIGKILL every process living in namespace `ns` (all ours: we made it)."""
    pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _marked_processes() -> list[int]:
    """Processes started by an EmulatedCluster (the head's Ray processes, and any
    node's): those whose environment has MARKER, or that have a file open in (or
    name in their command line) the Ray session directory in STATE_FILE."""
    session = None
    with contextlib.suppress(OSError, ValueError), open(STATE_FILE) as f:
        session = json.load(f).get("session_dir")
    found, marker = [], f"{MARKER}=".encode()
    for proc in glob.glob("/proc/[0-9]*"):
        pid = int(proc.rsplit("/", 1)[1])
        if pid == os.getpid():
            continue
        try:
            with open(f"{proc}/environ", "rb") as f:
                if any(v.startswith(marker) for v in f.read().split(b"\0")):
                    found.append(pid)
                    continue
            if session is None:
                continue
            with open(f"{proc}/cmdline", "rb") as f:
                if session.encode() in f.read():
                    found.append(pid)
                    continue
            for fd in os.listdir(f"{proc}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"{proc}/fd/{fd}").startswith(session + "/"):
                        found.append(pid)
                        break
        except OSError:
            continue
    return found


def cleanup_leftovers(kill_head: bool = True) -> dict:
    """Remove every netns and link named with the `dsgd` prefix (and kill the
    processes inside those namespaces; with `kill_head`, also every process an
    EmulatedCluster started, the head's included, found by MARKER in its
    environment): a crashed run's leftovers."""
    done = {"killed": [], "netns": [], "links": []}
    for ns in _our_netns():
        done["killed"] += _kill_netns_processes(ns)
    if kill_head:
        for pid in _marked_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                done["killed"].append(pid)
    if done["killed"]:
        time.sleep(0.5)
    for ns in _our_netns():
        _run("ip", "netns", "del", ns, check=False)
        done["netns"].append(ns)
    with contextlib.suppress(OSError):
        os.remove(STATE_FILE)
    for link in _our_links():
        if link != BRIDGE:
            _run("ip", "link", "del", link, check=False)
            done["links"].append(link)
    if BRIDGE in _our_links():
        _run("ip", "link", "del", BRIDGE, check=False)
        done["links"].append(BRIDGE)
    done["killed"] = sorted(set(done["killed"]))
    return done


# -- link measurements --------------------------------------------------------------

def _receive(ns: str, ip: str, port: int, ready: threading.Event, out: dict) -> None:
    with in_netns(ns):
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((ip, port))
        server.listen(1)
    ready.set()
    conn, _ = server.accept()
    buf = bytearray(1 << 20)
    got, start = 0, None
    while True:
        n = conn.recv_into(buf)
        if not n:
            break
        if start is None:
            start = time.perf_counter()
            first = n
        got += n
    end = time.perf_counter()
    conn.close()
    server.close()
    # From the end of the first read: the bytes after it over the time they took.
    out.update(bytes=got, seconds=end - start, mbit=(got - first) * 8 / (end - start) / 1e6)


def _send(ns: str, ip: str, port: int, nbytes: int) -> None:
    with in_netns(ns):
        client = socket.create_connection((ip, port), timeout=60)
    chunk = b"\0" * (1 << 20)
    left = nbytes
    while left > 0:
        client.sendall(chunk[:min(left, len(chunk))])
        left -= len(chunk)
    client.shutdown(socket.SHUT_WR)
    client.recv(1)
    client.close()


def throughput(pairs: list[tuple[int, int]], seconds: float, mbit: float) -> list[dict]:
    """Single-stream TCP throughput of each (src node, dst node), all at once."""
    nbytes = int(seconds * mbit * 1e6 / 8)
    threads, outs = [], []
    for k, (src, dst) in enumerate(pairs):
        ready, out = threading.Event(), {"from": src, "to": dst}
        receiver = threading.Thread(target=_receive, daemon=True,
                                    args=(netns_name(dst), node_ip(dst), THROUGHPUT_PORT + k,
                                          ready, out))
        receiver.start()
        ready.wait(10)
        sender = threading.Thread(target=_send, daemon=True,
                                  args=(netns_name(src), node_ip(dst), THROUGHPUT_PORT + k, nbytes))
        threads += [receiver, sender]
        outs.append(out)
    for t in threads[1::2]:
        t.start()
    for t in threads:
        t.join(seconds * 10 + 30)
    return outs


def round_trip_ms(src: int, dst: int, reps: int = 50) -> float:
    """Median round trip of a 1-byte TCP ping-pong, node src -> node dst -> src."""
    port = THROUGHPUT_PORT + 99
    ready = threading.Event()

    def echo():
        with in_netns(netns_name(dst)):
            server = socket.socket()
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((node_ip(dst), port))
            server.listen(1)
        ready.set()
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (b := conn.recv(1)):
            conn.sendall(b)
        conn.close()
        server.close()

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    ready.wait(10)
    with in_netns(netns_name(src)):
        client = socket.create_connection((node_ip(dst), port), timeout=10)
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        client.sendall(b"x")
        client.recv(1)
        times.append(time.perf_counter() - start)
    client.close()
    thread.join(10)
    return statistics.median(times) * 1e3


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields), idle


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# -- the cluster --------------------------------------------------------------------

class EmulatedCluster:
    """`num_nodes` Ray worker nodes, each in its own network namespace behind a
    shaped link (`link_mbit` per direction, `latency_ms` node -> node one way),
    plus a head node (num_cpus=0, the driver's) in the root namespace. A context
    manager: `with EmulatedCluster(4, 300) as cluster: run_dsgd(cluster, ...)`."""

    def __init__(self, num_nodes: int, link_mbit: float, latency_ms: float = 0.0,
                 object_store_bytes: int = 512 * MIB, head_object_store_bytes: int = 256 * MIB,
                 measure_link: bool = True):
        if not 2 <= num_nodes <= 8:
            raise ValueError(f"num_nodes must be 2..8, got {num_nodes}")
        if link_mbit <= 0 or latency_ms < 0:
            raise ValueError("link_mbit must be > 0 and latency_ms >= 0")
        self.num_nodes, self.link_mbit, self.latency_ms = num_nodes, float(link_mbit), latency_ms
        self.object_store_bytes = int(object_store_bytes)
        self.head_object_store_bytes = int(head_object_store_bytes)
        self._measure_link = measure_link
        self.cluster = None
        self.link: dict = {}
        self.node_names: dict[str, str] = {}  # Ray node id -> "head" / "n{i}"
        self._made_netns: list[str] = []
        self._made_links: list[str] = []
        self._closed = True
        self._sigterm = None
        self.start_s = None

    # -- life cycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        check_prerequisites()
        stale = _our_netns() + _our_links()
        if stale:
            raise RuntimeError(f"leftovers of an earlier run exist ({', '.join(stale)}); remove "
                               f"them with: python {os.path.relpath(__file__)} --cleanup")
        self._closed = False
        atexit.register(self.close)
        began = time.perf_counter()
        main_thread = threading.current_thread() is threading.main_thread()
        self._sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
        try:
            self._make_network()
            if self._measure_link:
                self.link = self.measure_link()
            self._start_ray()
            if main_thread:
                # Each ray.cluster_utils node set its own SIGTERM handler (the last
                # one wins and tears down only its node): SIGTERM is Ctrl-C instead,
                # so that close() runs.
                signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - began

    def close(self) -> None:
        """Shut Ray down and remove every namespace, veth and the bridge made here.
        Idempotent; also runs at exit."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
            self.cluster = None
        for key, value in getattr(self, "_env", {}).items():  # (a later cluster: Ray's own)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        killed = []
        for ns in self._made_netns:
            killed += _kill_netns_processes(ns)
        if killed:
            time.sleep(0.5)
        for ns in self._made_netns:
            _run("ip", "netns", "del", ns, check=False)
        for link in self._made_links:
            if link in _our_links():
                _run("ip", "link", "del", link, check=False)
        self._made_netns, self._made_links = [], []
        with contextlib.suppress(OSError):
            os.remove(STATE_FILE)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    # -- network
    def _make_network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge", "forward_delay", "0", "stp_state", "0")
        self._made_links.append(BRIDGE)
        _run("ip", "addr", "add", f"{HEAD_IP}/16", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        per_qdisc_delay = self.latency_ms / 2
        for i in range(self.num_nodes):
            ns, host, inner = netns_name(i), host_veth(i), ns_veth(i)
            _run("ip", "netns", "add", ns)
            self._made_netns.append(ns)
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
            self._made_links.insert(0, host)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", host, "master", BRIDGE)
            _run("ip", "link", "set", host, "up")
            _run("ip", "-n", ns, "addr", "add", f"{node_ip(i)}/16", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _shape(inner, ns, self.link_mbit, per_qdisc_delay)  # uplink
            _shape(host, None, self.link_mbit, per_qdisc_delay)  # downlink
        # Wait until every node reaches the head over the bridge.
        deadline = time.time() + 10
        for i in range(self.num_nodes):
            while True:
                try:
                    with in_netns(netns_name(i)):
                        probe = socket.socket()
                    probe.settimeout(1)
                    # Nothing listens: a refusal (RST) proves the path works.
                    with contextlib.suppress(ConnectionRefusedError):
                        probe.connect((HEAD_IP, 9))
                    probe.close()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise RuntimeError(f"node {i} ({node_ip(i)}) cannot reach {HEAD_IP}")
                    time.sleep(0.2)

    def measure_link(self, seconds: float = 2.0) -> dict:
        """Throughput (single TCP stream, node 0 -> node 1; then both directions at
        once) and the round trip node 0 <-> node 1, in Mbit/s and ms."""
        one = throughput([(0, 1)], seconds, self.link_mbit)[0]
        both = throughput([(0, 1), (1, 0)], seconds, self.link_mbit)
        rtt = round_trip_ms(0, 1)
        return {"shaped_mbit": self.link_mbit,
                "one_way_mbit": one["mbit"],
                "duplex_mbit": [b["mbit"] for b in both],
                "rtt_ms": rtt,
                "latency_ms_node_to_node_one_way": self.latency_ms,
                "netem_delay_ms_per_qdisc": self.latency_ms / 2}

    def tc_bytes(self) -> dict:
        """Bytes sent so far through each node's uplink and downlink qdisc."""
        return {f"n{i}": {"up": _tc_bytes(ns_veth(i), netns_name(i)),
                          "down": _tc_bytes(host_veth(i), None)}
                for i in range(self.num_nodes)}

    # -- Ray
    def _start_ray(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self._env = {key: os.environ.get(key) for key in (*RAY_ENV, MARKER)}
        for key, value in RAY_ENV.items():
            os.environ.setdefault(key, value)
        os.environ[MARKER] = HEAD_IP
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": HEAD_IP, "num_cpus": 0,
            "object_store_memory": self.head_object_store_bytes, "include_dashboard": False})
        self.node_names[self.cluster.head_node.node_id] = "head"
        with open(STATE_FILE, "w") as f:
            json.dump({"session_dir": self.cluster.head_node.get_session_dir_path(),
                       "driver_pid": os.getpid()}, f)
        nodes = []
        for i in range(self.num_nodes):
            with in_netns(netns_name(i)):
                node = self.cluster.add_node(
                    wait=False, node_ip_address=node_ip(i), num_cpus=1,
                    object_store_memory=self.object_store_bytes)
            nodes.append(node)
            self.node_names[node.node_id] = f"n{i}"
        self.cluster.wait_for_nodes(timeout=300)
        ray.init(address=self.cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        expected = {self.cluster.head_node.node_id: HEAD_IP}
        expected.update({node.node_id: node_ip(i) for i, node in enumerate(nodes)})
        for node_id, ip in expected.items():
            if node_id not in alive:
                raise RuntimeError(f"node {self.node_names[node_id]} ({ip}) did not register")
            if alive[node_id]["NodeManagerAddress"] != ip:
                raise RuntimeError(f"node {self.node_names[node_id]} registered with "
                                   f"{alive[node_id]['NodeManagerAddress']}, not {ip}")
        self._check_namespaces(nodes)

    def _check_namespaces(self, nodes) -> None:
        """Each worker node's raylet really runs inside its namespace."""
        for i, node in enumerate(nodes):
            pids = set(_run("ip", "netns", "pids", netns_name(i)).stdout.split())
            raylet = node.all_processes.get("raylet")
            pid = str(raylet[0].process.pid) if raylet else None
            if pid is None or pid not in pids:
                raise RuntimeError(f"node n{i}'s raylet (pid {pid}) is not inside "
                                   f"{netns_name(i)} (its pids: {sorted(pids)})")

    def layout(self) -> dict:
        return {"nodes": self.node_names}


# -- dsgd on it ---------------------------------------------------------------------

@functools.cache
def _models():
    """FlatModel and SleepyModel, pickled by value (benchmarks/ is not on the
    workers' path)."""
    import overlap
    import scaling_check
    from ray import cloudpickle

    for module in (overlap, scaling_check):
        cloudpickle.register_pickle_by_value(module)
    return scaling_check.FlatModel, overlap.SleepyModel


def _record_step_times() -> None:
    """train()'s summary also carries every step's times (the engine keeps them
    driver side; only their median and means are returned)."""
    from dsgd.engine import training

    if getattr(training.Tally.summary, "_with_step_times", False):
        return
    original = training.Tally.summary

    def summary(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out["step_times"] = {k: [float(x) for x in v] for k, v in self.times.items()}
        return out

    summary._with_step_times = True
    training.Tally.summary = summary


def model_creator(model: dict):
    """A picklable model_creator(worker, device) for a model spec: {"name": "flat",
    "mib", "num_variables"} or {"name": "sleepy", "layers", "forward_ms", "backward_ms"}."""
    flat_model, sleepy_model = _models()
    if model["name"] == "flat":
        mib, nvars = model["mib"], model["num_variables"]
        return lambda w, d: flat_model(mib, nvars)
    if model["name"] == "sleepy":
        layers, fwd, bwd = model["layers"], model["forward_ms"] / 1e3, model["backward_ms"] / 1e3
        return lambda w, d: sleepy_model(layers, fwd, bwd)
    raise ValueError(f"unknown model {model['name']!r}")


def model_bytes(model: dict) -> int:
    if model["name"] == "flat":
        return int(model["mib"] * MIB / 4 / model["num_variables"]) * 4 * model["num_variables"]
    return model["layers"] * 4 * MIB


def run_dsgd(cluster: EmulatedCluster, model: dict, steps: int, warmup: int, *,
             rounds: int = 1, **options) -> dict:
    """Run dsgd on `cluster`: one worker per node, `warmup` steps of train(), then
    `rounds` measured train(`steps`) calls. `model`: a spec for `model_creator`;
    `options` go to DistributedSGD (grad_shard_bytes, num_ps, overlap,
    step_timeout_s, ...).

    Returns "step_s" (the median over the rounds of each train()'s median step
    time), "round_step_s" (each round's), "step_times" (each round's per-step times
    as train() records them: under the workers' own exchange one actor call runs
    up to max(8, 4 x N) steps, and each of its steps gets the call's mean, so these
    vary per call, not per step), "mean_times" (train()'s, averaged over the
    rounds), where the workers and PS actors ran ("head"/"n{i}"), the bytes through
    every node's shaped uplink/downlink during the measured rounds (and per step),
    and the fraction of all cores busy meanwhile."""
    import dsgd

    _record_step_times()
    options.setdefault("step_timeout_s", 300)
    began = time.perf_counter()
    sgd = dsgd.DistributedSGD(model_creator(model), cluster.num_nodes, 1, gpu=False, **options)
    try:
        started_s = time.perf_counter() - began
        names = cluster.node_names
        workers = [names.get(info["node_id"], info["node_id"]) for info in sgd.worker_info]
        ps = [names.get(info["node_id"], info["node_id"]) for info in sgd.ps_info]
        if len(set(workers)) != cluster.num_nodes or "head" in workers:
            raise RuntimeError(f"workers are not one per node: {workers}")
        if warmup:
            sgd.train(warmup, desc="warmup")
        before, cpu_before = cluster.tc_bytes(), _cpu_times()
        summaries = [sgd.train(steps, desc="measured") for _ in range(rounds)]
        after, cpu_after = cluster.tc_bytes(), _cpu_times()
        overlaps = sgd.config.during_backward
        shard_bytes = sgd.config.grad_shard_bytes
    finally:
        sgd.shutdown()
    total = cpu_after[0] - cpu_before[0]
    busy = 1.0 - (cpu_after[1] - cpu_before[1]) / total if total else float("nan")
    measured = steps * rounds
    tc = {node: {d: after[node][d] - before[node][d] for d in ("up", "down")} for node in after}
    return {"step_s": statistics.median(s["step_s"] for s in summaries),
            "round_step_s": [s["step_s"] for s in summaries],
            "step_times": [s["step_times"]["step_s"] for s in summaries],
            "mean_times": {k: statistics.mean(s["mean_times"][k] for s in summaries)
                           for k in summaries[0]["mean_times"]},
            "train_s": [s["train_s"] for s in summaries],
            "steps": steps, "rounds": rounds, "warmup": warmup, "overlap_resolved": overlaps,
            "worker_nodes": workers, "ps_nodes": ps, "grad_shard_bytes": shard_bytes,
            "tc_bytes": tc,
            "tc_bytes_per_step": {node: {d: v / measured for d, v in dirs.items()}
                                  for node, dirs in tc.items()},
            "cpu_busy": busy, "start_s": started_s,
            "wall_s": time.perf_counter() - began}


# -- CLI ----------------------------------------------------------------------------

def grid(nodes: int, layouts: str = "both") -> list[tuple[dict, dict]]:
    """(model spec, DistributedSGD options) of each run on `nodes` nodes. `layouts`:
    "explicit" (shards and PS count set per run, the grid the simulator was checked
    on first), "default" (the sleepy model in the layout dsgd picks itself: one PS
    per node, the gradient spread equally over them; overlapped, as `gpu=True`
    runs it, and after the backward pass), or "both"."""
    flat = {"name": "flat", "mib": 8.0, "num_variables": 16}
    sleepy = {"name": "sleepy", "layers": 4, "forward_ms": 10.0, "backward_ms": 20.0}
    explicit = [
        (flat, {"grad_shard_bytes": (8 * MIB) // nodes, "num_ps": nodes, "overlap": None}),
        (sleepy, {"grad_shard_bytes": 4 * MIB, "num_ps": min(nodes, 4), "overlap": True}),
        (sleepy, {"grad_shard_bytes": 4 * MIB, "num_ps": min(nodes, 4), "overlap": False}),
    ]
    default = [(sleepy, {"overlap": True}), (sleepy, {"overlap": False})]
    return {"explicit": explicit, "default": default, "both": explicit + default}[layouts]


def _ring_models(nodes: int, names: list[str]) -> list[dict]:
    """Each model of the grid once (the ring has no shard or PS options)."""
    out = []
    for model, _ in grid(nodes, "explicit"):
        if model["name"] in names and model not in out:
            out.append(model)
    return out


def _ring_run(cluster: EmulatedCluster, model: dict, args, link_mbit: float) -> dict:
    """One Horovod ring run of `model` on `cluster` (emulated_ring.py), as an entry
    of the runs (`system` "horovod"; dsgd's entries have none)."""
    import emulated_ring

    entry = {"system": "horovod", "nodes": cluster.num_nodes, "model": model["name"],
             "model_params": {k: v for k, v in model.items() if k != "name"},
             "model_bytes": model_bytes(model), "link_mbit": link_mbit,
             "latency_ms": args.latency_ms, "measured_link": cluster.link}
    label = f"horovod ring, {model['name']} {model_bytes(model) / MIB:g} MiB"
    print(f"   {label} ...", end=" ", flush=True)
    why = emulated_ring.available()
    if why is not None:
        entry["error"] = why
        print(f"not run: {why}", flush=True)
        return entry
    try:
        entry.update(emulated_ring.run_horovod(cluster, model, args.steps, args.warmup,
                                               rounds=args.rounds))
        entry["link_floor_s"] = max(max(v.values()) for v in
                                    entry["tc_bytes_per_step"].values()) * 8 / (link_mbit * 1e6)
        print(f"step {entry['step_s'] * 1e3:.0f} ms (one rank {entry['one_rank_step_s'] * 1e3:.0f}"
              f" ms, link floor {entry['link_floor_s'] * 1e3:.0f} ms, cpu busy "
              f"{entry['cpu_busy']:.0%}, {entry['wall_s']:.0f}s)", flush=True)
    except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
        entry["error"] = f"{type(e).__name__}: {e}"
        print(f"FAILED: {entry['error'][:2000]}", flush=True)
    return entry


def platform_info() -> dict:
    import ray

    info = {"python": platform.python_version(), "machine": platform.machine(),
            "kernel": platform.release(), "cpus": os.cpu_count(), "ray": ray.__version__}
    with contextlib.suppress(Exception), open("/proc/meminfo") as f:
        info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    with contextlib.suppress(Exception):
        info["iproute2"] = _run("ip", "-V").stdout.strip()
    with contextlib.suppress(Exception):
        info["dsgd_commit"] = _run("git", "-C", REPO, "rev-parse", "HEAD").stdout.strip()
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=8, help="steps per measured train() call")
    parser.add_argument("--rounds", type=int, default=2, help="measured train() calls per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="every node's link, Mbit/s per direction (default: "
                             "--aggregate-mbit / nodes)")
    parser.add_argument("--aggregate-mbit", type=float, default=640.0,
                        help="without --link-mbit: the links of N nodes add up to this (2 shared "
                             "cores move ~150 MiB/s of Ray transfers at most: a fixed total keeps "
                             "the network, not the cores, the bound at every N)")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="added node -> node one-way delay (half on each node's link)")
    parser.add_argument("--store-mib", type=int, default=512, help="object store per worker node")
    parser.add_argument("--models", nargs="+", default=["flat", "sleepy"])
    parser.add_argument("--layouts", choices=["explicit", "default", "both"], default="both",
                        help="dsgd's runs: the explicit grid, dsgd's default layout, or both")
    parser.add_argument("--ring", action="store_true",
                        help="also run Horovod's ring (Gloo) on the same nodes and links, each "
                             "model once (emulated_ring.py; needs benchmarks/peers/setup_horovod.sh)")
    parser.add_argument("--no-dsgd", action="store_true", help="with --ring: the ring runs only")
    parser.add_argument("--out", default=os.path.join(BENCHMARKS, "results", "emulated.json"))
    parser.add_argument("--cleanup", action="store_true",
                        help="remove leftovers (dsgd-* netns, dsgd* links, their processes) "
                             "of a crashed run, then exit")
    args = parser.parse_args(argv)
    if args.cleanup:
        check_prerequisites()
        print(json.dumps(cleanup_leftovers()))
        return 0
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    for path in glob.glob("/tmp/__autograph_generated_file*"):
        with contextlib.suppress(OSError):
            os.remove(path)

    result = {"description": "dsgd on an emulated cluster: one Ray node per network namespace, "
                             "each behind an htb-shaped veth (see emulated.py's docstring)",
              "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
              "platform": None, "clusters": [], "runs": []}
    began = time.perf_counter()

    def write():
        result["grid_wall_s"] = time.perf_counter() - began
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for nodes in args.nodes:
        link_mbit = args.link_mbit or round(args.aggregate_mbit / nodes, 3)
        print(f"== {nodes} nodes, {link_mbit:g} Mbit/s, {args.latency_ms:g} ms", flush=True)
        with EmulatedCluster(nodes, link_mbit, args.latency_ms,
                             args.store_mib * MIB) as cluster:
            if result["platform"] is None:
                result["platform"] = platform_info()
            link = cluster.link
            print(f"   started in {cluster.start_s:.1f}s; link {link['one_way_mbit']:.1f} Mbit/s "
                  f"one way, {'/'.join(f'{x:.1f}' for x in link['duplex_mbit'])} duplex, "
                  f"rtt {link['rtt_ms']:.2f} ms", flush=True)
            result["clusters"].append({"nodes": nodes, "start_s": cluster.start_s, "link": link,
                                       "object_store_bytes": cluster.object_store_bytes})
            for model, options in grid(nodes, args.layouts):
                if model["name"] not in args.models or args.no_dsgd:
                    continue
                label = (f"{model['name']} {model_bytes(model) / MIB:g} MiB, " + (
                    f"shard {options['grad_shard_bytes']}, {options['num_ps']} PS"
                    if "num_ps" in options else "default layout")
                    + f", overlap {options['overlap']}")
                print(f"   {label} ...", end=" ", flush=True)
                entry = {"nodes": nodes, "model": model["name"],
                         "model_params": {k: v for k, v in model.items() if k != "name"},
                         "model_bytes": model_bytes(model),
                         "layout": "explicit" if "num_ps" in options else "default",
                         "num_ps": None, **options,
                         "link_mbit": link_mbit, "latency_ms": args.latency_ms,
                         "measured_link": link}
                try:
                    entry.update(run_dsgd(cluster, model, args.steps, args.warmup,
                                           rounds=args.rounds, **options))
                    ups = [v["up"] for v in entry["tc_bytes_per_step"].values()]
                    # The busiest link direction's bytes (L2, as tc counts them) at the rate.
                    entry["link_floor_s"] = max(max(v.values()) for v in
                                                entry["tc_bytes_per_step"].values()) \
                        * 8 / (link_mbit * 1e6)
                    print(f"step {entry['step_s'] * 1e3:.0f} ms (link floor "
                          f"{entry['link_floor_s'] * 1e3:.0f} ms, cpu busy "
                          f"{entry['cpu_busy']:.0%}, up/step {min(ups) / MIB:.1f}.."
                          f"{max(ups) / MIB:.1f} MiB, ps on {entry['ps_nodes']}, "
                          f"{entry['wall_s']:.0f}s)", flush=True)
                except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
                    entry["error"] = f"{type(e).__name__}: {e}"
                    print(f"FAILED: {entry['error']}", flush=True)
                result["runs"].append(entry)
                write()
            if args.ring:
                for model in _ring_models(nodes, args.models):
                    result["runs"].append(_ring_run(cluster, model, args, link_mbit))
                    write()
    write()
    print(f"wrote {args.out} ({result['grid_wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
