"""The tree sampler sums memory over the live processes and keeps each process's CPU at its last sample."""

from __future__ import annotations

import os

import psutil

from benchmarks.process_tree import TreeSampler


def test_a_sample_of_this_process_reads_its_memory_and_cpu() -> None:
    sampler = TreeSampler(os.getpid())
    sum(i * i for i in range(300_000))  # some CPU time of our own
    sampler.sample()
    me = psutil.Process()  # with its children: brokers the suite started earlier are part of the tree
    tree_rss = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
    summary = sampler.summary()
    assert os.getpid() in sampler.processes and sampler.cpu[os.getpid()] > 0
    assert 0 < summary["tree_peak_pss_mib"] * 2**20 <= tree_rss * 1.05  # PSS never exceeds RSS (shared pages split)
    assert summary["tree_cpu_seconds"] >= 0 and summary["tree_processes"] >= 1


def test_a_tree_that_is_gone_leaves_the_figures_as_they_were() -> None:
    sampler = TreeSampler(2**22 + 12345)  # no such pid
    sampler.sample()
    assert sampler.summary() == {
        "tree_peak_pss_mib": 0.0,
        "tree_memory_is_pss": True,
        "tree_cpu_seconds": 0.0,
        "tree_processes": 0,
    }


def test_memory_is_read_at_most_every_memory_every_s_while_cpu_is_read_every_sample() -> None:
    sampler = TreeSampler(os.getpid(), memory_every_s=3600)
    sampler.sample()
    first_peak, first_cpu = sampler.peak_bytes, sampler.cpu[os.getpid()]
    grown = b"x" * (64 * 2**20)  # 64 MiB more, every page written
    sum(i * i for i in range(300_000))
    sampler.sample()
    assert sampler.peak_bytes == first_peak and sampler.cpu[os.getpid()] > first_cpu
    sampler.memory_every_s = 0
    sampler.sample()
    assert sampler.peak_bytes >= first_peak + 60 * 2**20
    del grown
