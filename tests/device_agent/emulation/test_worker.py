"""A worker's list of devices, and how emulate turns per-device agents into workers."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

from device_agent.agent import probe
from device_agent.agent.config import ConfigError, EmulationConfig, load_config
from device_agent.common.profile import ComputeSpec
from device_agent.emulation.launcher import AgentSpec, pack_specs, worker_command, write_agent_list
from device_agent.emulation.limits import EmulatedDevice
from device_agent.emulation.profile_config import DataShare, agent_config, password_env, write_agent_config
from device_agent.emulation.slots import ComputeSlots
from device_agent.emulation.worker import Worker, read_agent_list
from device_agent.training.driver import run_assignment
from device_agent.training.local_round import TrainedRound
from tests.device_agent.recorder_port import agent_yaml, heard, recorder_installed
from tests.device_agent.training.test_driver import NothingKept, digits, fedavg_round
from tests.device_profiles import reported_profile


def _agent(tmp_path: Path, index: int, device_type: str = "cpu") -> AgentSpec:
    device = f"dev-{index:02d}"
    folder = tmp_path / device
    config = agent_config(
        device,
        "lab",
        "mqtt://127.0.0.1:1883",
        DataShare("digits", "iid", 0, index, 4),
        folder / "state",
        None,
        password=f"env:{password_env(index)}",
        device_type=device_type,
    )
    return AgentSpec(
        device, write_agent_config(folder / "agent.yaml", config), folder / "agent.log", 1, {password_env(index): "pw"}
    )


def test_devices_are_packed_into_workers_that_list_their_agent_files(tmp_path: Path) -> None:
    specs = [_agent(tmp_path, i) for i in range(4)]
    workers = pack_specs(specs, [range(0, 3), range(3, 4)], tmp_path / "workers")
    assert [w.device for w in workers] == ["worker-00", "worker-01"]
    assert [c.device for c in read_agent_list(workers[0].config)] == ["dev-00", "dev-01", "dev-02"]
    assert workers[0].log == tmp_path / "workers" / "worker-00.log"
    # each device keeps its own password variable; the worker's environment carries all of its devices'
    passwords = {"FEDFLEET_PASSWORD_0", "FEDFLEET_PASSWORD_1", "FEDFLEET_PASSWORD_2"}
    assert set(workers[0].env) == passwords | {"MALLOC_ARENA_MAX"}
    assert workers[0].env["MALLOC_ARENA_MAX"] == "1"  # one malloc arena: memory follows the slot, not the threads
    assert worker_command(workers[1].config, threads=2)[-5:] == [
        "worker",
        "--agents",
        str(workers[1].config),
        "--threads",
        "2",
    ]


def test_an_operators_malloc_arena_setting_wins(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    (worker,) = pack_specs([_agent(tmp_path, 0)], [range(1)], tmp_path / "workers")
    assert worker.env["MALLOC_ARENA_MAX"] == "4"


def test_devices_sharing_a_password_variable_cannot_share_a_worker(tmp_path: Path) -> None:
    first, second = _agent(tmp_path, 0), _agent(tmp_path, 1)
    clashing = AgentSpec(second.device, second.config, second.log, 1, dict(first.env))
    with pytest.raises(ValueError, match=r"share environment variable.*FEDFLEET_PASSWORD_0"):
        pack_specs([first, clashing], [range(2)], tmp_path / "workers")


def test_bad_agent_lists_are_named(tmp_path: Path) -> None:
    one, gpu = _agent(tmp_path, 0), _agent(tmp_path, 1, device_type="cuda")
    twice = write_agent_list(tmp_path / "twice.yaml", [one.config, one.config])
    with pytest.raises(ConfigError, match="listed twice: dev-00"):
        read_agent_list(twice)
    mixed = write_agent_list(tmp_path / "mixed.yaml", [one.config, gpu.config])
    with pytest.raises(ConfigError, match="one worker trains on one device type, got cpu, cuda"):
        read_agent_list(mixed)
    (tmp_path / "empty.yaml").write_text(yaml.safe_dump({"agents": []}))
    with pytest.raises(ConfigError, match=r"expected a non-empty list of agent\.yaml paths"):
        read_agent_list(tmp_path / "empty.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        read_agent_list(tmp_path / "missing.yaml")
    crowded = tmp_path / "crowded.yaml"
    crowded.write_text(yaml.safe_dump([f"dev-{i}/agent.yaml" for i in range(321)]))
    with pytest.raises(ConfigError, match=r"321 devices, more than the 320 one worker can hold"):
        read_agent_list(crowded)


def test_devices_of_a_worker_whose_slots_own_threads_compute_only_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA worker does (its slots own the threads), shown on CPU: every forward pass runs on a slot's thread."""
    slots = ComputeSlots(1, own_threads=True)
    ran_on: set[str] = set()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda *_: ran_on.add(threading.current_thread().name)
    )
    try:
        rounds = []
        devices = [EmulatedDevice(EmulationConfig(), torch.device("cpu"), slots) for _ in range(3)]
        threads = [
            threading.Thread(
                target=lambda h=hooks: rounds.append(run_assignment(*fedavg_round(1), digits, NothingKept(), hooks=h))
            )
            for hooks in devices
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        handle.remove()
        slots.close()
    assert len(rounds) == 3 and all(isinstance(trained, TrainedRound) for trained in rounds)
    assert len(ran_on) == 1 and next(iter(ran_on)).startswith("fedfleet-compute")


def _gpu_bytes_used_by_devices(devices: int, slots: ComputeSlots | None) -> int:
    """GPU memory the process gains while ``devices`` threads each run a conv and a linear step, all alive at once."""
    cuda = torch.device("cuda")
    conv, linear = torch.nn.Conv2d(1, 8, 3).to(cuda), torch.nn.Linear(8 * 12 * 12, 10).to(cuda)

    def work() -> None:
        linear(conv(torch.randn(16, 1, 14, 14, device=cuda)).flatten(1)).sum().backward()

    all_alive = threading.Barrier(devices)

    def device() -> None:
        if slots is None:
            work()
        else:
            with slots.turn(lambda: 0.0):
                slots.run(work)
        all_alive.wait()

    work()  # the kernels load and this thread's handles are made before measuring
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    threads = [threading.Thread(target=device) for _ in range(devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    torch.cuda.synchronize()
    return free_before - torch.cuda.mem_get_info()[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_workers_devices_share_the_slots_library_handles_instead_of_one_set_each() -> None:
    slots = ComputeSlots(1, own_threads=True)
    try:
        through_slots = _gpu_bytes_used_by_devices(16, slots)
    finally:
        slots.close()
    each_their_own = _gpu_bytes_used_by_devices(16, None)
    mib = 2**20
    print(f"16 devices: {through_slots / mib:.0f} MiB via one slot thread, {each_their_own / mib:.0f} MiB on their own")
    assert each_their_own > 4 * max(through_slots, 2**20)


def test_a_worker_serves_its_devices_over_the_port_kind_their_agent_yaml_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hellos = threading.Semaphore(0)
    with recorder_installed(tmp_path / "site"):
        monkeypatch.setattr(sys.modules["recorder_port"], "after_hello", hellos.release)  # the worker is this process
        folders = [tmp_path / device for device in ("dev-00", "dev-01")]
        configs = [load_config(agent_yaml(folder, device=folder.name)) for folder in folders]
        worker = Worker(configs, profile=reported_profile())
        assert worker.batcher is None  # a CPU worker trains its devices' steps one by one unless told
        serving = threading.Thread(target=worker.run, kwargs={"stagger_s": 0.0}, daemon=True)
        serving.start()
        try:
            assert hellos.acquire(timeout=60) and hellos.acquire(timeout=60)
        finally:
            worker.stop()
            serving.join(30)

    assert [type(agent.port).__name__ for agent in worker.agents] == ["RecorderPort", "RecorderPort"]
    for folder in folders:
        said = heard(folder / "state")
        assert said[0]["type"] == "hello" and said[0]["device"] == folder.name and said[-1] == {"stopped": True}
    assert worker.errors == {}


def test_a_worker_whose_devices_report_their_profiles_compute_does_not_benchmark_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``coordinator emulate`` paces every device in device time with its profile's compute section, which replaces
    the host's in ``hello``: the worker reports it without running the probe's benchmarks (~1.7 CPU-s each)."""
    benchmarked: list[str] = []
    monkeypatch.setattr(probe, "measure_matmul_gflops", lambda *args: benchmarked.append("matmul") or 50.0)
    compute = ComputeSpec(fp32_gflops=12.5, memory_bandwidth_gbs=4.0)
    paced = EmulationConfig(step_seconds={1.0: 0.01}, compute=compute)
    specs = [_agent(tmp_path, index) for index in range(2)]
    for spec in specs:
        for name, value in spec.env.items():
            monkeypatch.setenv(name, value)
    configs = [load_config(spec.config) for spec in specs]
    worker = Worker([c.model_copy(update={"emulation": paced}) for c in configs])
    assert benchmarked == []
    assert [agent.profile.compute for agent in worker.agents] == [compute, compute]
    assert worker.agents[0].profile.matmul_gflops == 12.5

    one_unpaced = [configs[0].model_copy(update={"emulation": paced}), configs[1]]
    Worker(one_unpaced)
    assert benchmarked == ["matmul"]  # a device held to the host's own speed needs the host measured


_FAULTS = """
import resource, sys
import torch
from device_agent.models.cnn import SmallCNN
torch.set_num_threads(1)
if sys.argv[1] == "reuse":
    from device_agent.emulation.worker import reuse_freed_memory
    reuse_freed_memory()
model, images = SmallCNN(), torch.randn(200, 1, 14, 14)


def device_round():  # a device's evaluation and one step on the scale benchmark's 14 px images
    with torch.no_grad():
        model(images)
    model(images[:16]).sum().backward()


device_round()  # the first pages in the kernels' code and the heap: counted in neither mode
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    device_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_worker_keeps_freed_activations_in_the_heap_instead_of_faulting_fresh_pages_in() -> None:
    """Without a large tensor freed first, glibc gives the heap's freed top back and each evaluation's activations
    fault their pages in again (a fresh process each: the allocator's thresholds are the process's)."""
    faults = {}
    for mode in ("fresh", "reuse"):
        run = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
        faults[mode] = int(run.stdout)
    assert faults["reuse"] < faults["fresh"] / 4, faults  # 9-30x quiet or under two busy loops
