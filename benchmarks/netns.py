"""Network namespaces joined to this host by veth pairs: other "hosts" on one machine, for end-to-end runs.

Each :class:`Namespace` is a host of its own as far as the network goes: its own loopback, one veth
whose other end is in this (root) namespace, and (with ``gateway``) a default route through it, so it
reaches every address of this host but nothing beyond. Needs root. Used by ``benchmarks.device_e2e``
(a chrooted arm64 device) and ``tests/e2e/test_workers_on_other_hosts.py`` (emulated worker hosts).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run ``command``; on failure raise with its output (the last lines) instead of a bare exit status."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}:\n{tail}")
    return done


def netns_problem() -> str | None:
    """Why network namespaces cannot be made here (not root, no ``ip``, ``ip netns`` fails), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "ip (iproute2) is not installed: apt-get install -y iproute2"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return None


class Namespace:
    """A network namespace joined to this host by one veth pair: ``host_ip`` here, ``device_ip`` there (/24).

    ``name`` and ``link`` (the veth names' stem, at most 8 characters) get this process's id appended, so
    runs side by side never collide. Everything goes on exit, and on a failure half-way through setting up.
    """

    def __init__(self, name: str, link: str, host_ip: str, device_ip: str, *, gateway: bool = False) -> None:
        tag = os.getpid() % 100000
        self.name, self.host_if, self.device_if = f"{name}-{tag}", f"{link}{tag}h", f"{link}{tag}d"
        self.host_ip, self.device_ip, self.gateway = host_ip, device_ip, gateway

    def __enter__(self) -> Namespace:
        try:
            run(["ip", "netns", "add", self.name])
            run(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.device_if])
            run(["ip", "link", "set", self.device_if, "netns", self.name])
            run(["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if])
            run(["ip", "link", "set", self.host_if, "up"])
            inside = [
                ["ip", "addr", "add", f"{self.device_ip}/24", "dev", self.device_if],
                ["ip", "link", "set", self.device_if, "up"],
                ["ip", "link", "set", "lo", "up"],
            ]
            if self.gateway:  # this host's other addresses (another veth's, say) through this veth
                inside.append(["ip", "route", "add", "default", "via", self.host_ip])
            for command in inside:
                run(["ip", "netns", "exec", self.name, *command])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]
