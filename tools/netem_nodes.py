#!/usr/bin/env python3
"""Emulate m nodes on one machine: one network namespace per node, a shaped link per node.

    sudo tools/netem_nodes.py up --nodes 2 --rate 1gbit     # prints the namespaces and addresses
    sudo ip netns exec xrn0 python ...                       # run node 0's ranks inside its namespace
    sudo tools/netem_nodes.py down

Topology: a "switch" namespace holds a bridge; node i's namespace ``<prefix>n<i>`` is joined to it
by a veth pair (``v<i>`` inside the node, ``s<i>`` on the switch). Both ends get a TBF rate limit,
so each node's "NIC" carries ``rate`` in each direction; traffic between ranks of one node stays
on that namespace's loopback (unshaped), as on a real node. netem is not available in this kernel;
TBF is (anchors.md: 1 gbit measured 0.92 Gbit/s). Only addresses inside the namespaces created
here are used (10.213.0.0/24), and ``down`` (or leaving the context manager) deletes them all.
Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_PREFIX = "xr"
SUBNET = "10.213.0"


@dataclass(frozen=True)
class NodeNS:
    """One emulated node: its namespace, interface and address."""

    index: int
    netns: str
    ifname: str
    addr: str

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """None if namespaces can be created here, else the reason they cannot."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{DEFAULT_PREFIX}probe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Existing namespaces created by this tool with ``prefix``."""
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n == f"{prefix}sw" or (n.startswith(f"{prefix}n") and n[len(prefix) + 1:].isdigit())]


def down(prefix: str = DEFAULT_PREFIX) -> None:
    """Delete every namespace of ``prefix`` (their veths go with them)."""
    for n in namespaces(prefix):
        _ip("netns", "del", n, check=False)


def _shape(netns: str, dev: str, rate: str) -> None:
    if rate in ("", "none", "0"):
        return
    subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "50ms"], check=True, capture_output=True, text=True)


def up(nodes: int, rate: str = "1gbit", prefix: str = DEFAULT_PREFIX) -> list[NodeNS]:
    """Create the switch and ``nodes`` node namespaces with a ``rate`` TBF on every node link."""
    if not 1 <= nodes <= 200:
        raise ValueError(f"nodes={nodes}: use 1..200")
    down(prefix)
    sw = f"{prefix}sw"
    try:
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        out = []
        for i in range(nodes):
            ns = f"{prefix}n{i}"
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", f"v{i}", "type", "veth", "peer", "name", f"s{i}", "netns", sw)
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", f"v{i}")
            _ip("-n", ns, "link", "set", f"v{i}", "up")
            _ip("-n", sw, "link", "set", f"s{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"s{i}", "up")
            _shape(ns, f"v{i}", rate)
            _shape(sw, f"s{i}", rate)
            out.append(NodeNS(i, ns, f"v{i}", f"{SUBNET}.{i + 1}"))
        return out
    except BaseException:
        down(prefix)
        raise


@contextlib.contextmanager
def emulated_nodes(nodes: int, rate: str = "1gbit", prefix: str = DEFAULT_PREFIX) -> Iterator[list[NodeNS]]:
    """``up`` on entry, ``down`` on exit (also on errors)."""
    try:
        yield up(nodes, rate, prefix)
    finally:
        down(prefix)


def tx_bytes(node: NodeNS) -> int:
    """Bytes sent by the node's interface (read from inside its namespace)."""
    r = subprocess.run([*node.exec_prefix(), "cat", f"/sys/class/net/{node.ifname}/statistics/tx_bytes"],
                       check=True, capture_output=True, text=True)
    return int(r.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    """CLI: up | down | status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="TBF rate per node link and direction (tc syntax), or none")
    ap.add_argument("--prefix", default=DEFAULT_PREFIX)
    a = ap.parse_args(argv)
    if a.action == "down":
        down(a.prefix)
        return 0
    if a.action == "status":
        print("\n".join(namespaces(a.prefix)) or "(none)")
        return 0
    why = available()
    if why:
        print(f"netem_nodes: {why}", file=sys.stderr)
        return 2
    for n in up(a.nodes, a.rate, a.prefix):
        print(f"node {n.index}: netns {n.netns} dev {n.ifname} addr {n.addr} (run: ip netns exec {n.netns} ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
