"""Memory and CPU of a whole process tree, sampled: what a fleet run costs the host, whoever spawned what.

Both sides of ``--scale --peer flower`` are a process and its descendants (``coordinator emulate`` with
its broker and workers; Flower's driver with Ray's GCS, raylet and actors), so they are measured alike:
the PSS of every live process summed per sample (PSS splits shared pages between the processes that
map them, so the sum does not count torch's libraries once per process), and each process's user +
system CPU seconds at its last sample, summed over every pid ever seen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

_MIB = 2**20


def _pss(process: psutil.Process) -> tuple[int, bool]:
    """(bytes, True) from PSS, or (RSS bytes, False) where smaps cannot be read.

    From ``smaps_rollup``, one line per process: psutil's ``memory_full_info`` formats ``smaps`` for every
    mapping, and a worker's hundreds of thread stacks made the sampler itself 9 % of a 2-core host's CPU (perf).
    """
    try:
        with open(f"/proc/{process.pid}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024, True
    except FileNotFoundError:
        if not psutil.pid_exists(process.pid):
            raise psutil.NoSuchProcess(process.pid) from None
    except (PermissionError, ProcessLookupError):
        pass
    try:
        return process.memory_full_info().pss, True
    except (psutil.AccessDenied, AttributeError):
        return process.memory_info().rss, False


@dataclass
class TreeSampler:
    """Call :meth:`sample` every few tenths of a second while the tree runs; read the peaks after.

    Memory is read at most every ``memory_every_s``: the kernel walks every page table of the tree for PSS,
    and at 1,000 emulated devices a walk every 0.5 s was 12 % of a 2-core host's CPU (perf), taken from
    the run it measured.
    """

    root: int
    memory_every_s: float = 2.0
    peak_bytes: int = 0
    pss: bool = True
    cpu: dict[int, float] = field(default_factory=dict)
    processes: set[int] = field(default_factory=set)
    _memory_at: float = float("-inf")

    def sample(self) -> None:
        try:
            top = psutil.Process(self.root)
            tree = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        now = time.monotonic()
        memory = now - self._memory_at >= self.memory_every_s
        total = 0
        for process in tree:
            try:
                times = process.cpu_times()
                if memory:
                    size, exact = _pss(process)
                    total += size
                    self.pss &= exact
            except psutil.NoSuchProcess:
                continue
            self.cpu[process.pid] = times.user + times.system
            self.processes.add(process.pid)
        if memory:
            self._memory_at = now
            self.peak_bytes = max(self.peak_bytes, total)

    def summary(self) -> dict[str, float | int | bool]:
        return {
            "tree_peak_pss_mib": round(self.peak_bytes / _MIB, 1),
            "tree_memory_is_pss": self.pss,
            "tree_cpu_seconds": round(sum(self.cpu.values()), 1),
            "tree_processes": len(self.processes),
        }
