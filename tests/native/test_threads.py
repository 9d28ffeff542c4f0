"""The thread counts read from the machine: the CPUs this process may use, and the physical cores
among them that llama.cpp's compute takes by default. A fake ``/sys`` stands for the machine."""

from __future__ import annotations

from pathlib import Path

from aiollama.native import available_cpus, math_cpus


def _machine(root: Path, siblings: dict[int, str], quota: str | None = None) -> Path:
    for cpu, listed in siblings.items():
        topology = root / f"devices/system/cpu/cpu{cpu}/topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(listed + "\n")
    if quota is not None:
        (root / "fs/cgroup").mkdir(parents=True)
        (root / "fs/cgroup/cpu.max").write_text(quota + "\n")
    return root


SMT_4X2 = {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}


def test_two_hardware_threads_of_a_core_count_once(tmp_path: Path) -> None:
    root = _machine(tmp_path, SMT_4X2)
    assert available_cpus(root, allowed=range(8)) == 8
    assert math_cpus(root, allowed=range(8)) == 4


def test_only_the_cores_of_the_affinity_mask_count(tmp_path: Path) -> None:
    root = _machine(tmp_path, SMT_4X2)
    assert math_cpus(root, allowed={0, 4}) == 1  # both threads of one core
    assert math_cpus(root, allowed={0, 1, 5}) == 2
    assert available_cpus(root, allowed={0, 1, 5}) == 3


def test_cores_without_siblings_each_count(tmp_path: Path) -> None:
    root = _machine(tmp_path, {0: "0", 1: "1"})
    assert math_cpus(root, allowed={0, 1}) == 2


def test_a_cpu_whose_topology_is_not_shown_counts_as_a_core(tmp_path: Path) -> None:
    root = _machine(tmp_path, {0: "0-1", 1: "0-1"})
    assert math_cpus(root, allowed={0, 1, 2, 3}) == 3  # cpu2 and cpu3 unknown


def test_a_cgroup_quota_caps_both_counts(tmp_path: Path) -> None:
    root = _machine(tmp_path, SMT_4X2, quota="250000 100000")  # 2.5 CPUs
    assert available_cpus(root, allowed=range(8)) == 2
    assert math_cpus(root, allowed=range(8)) == 2
    small = _machine(tmp_path / "small", SMT_4X2, quota="20000 100000")  # a fifth of a CPU
    assert math_cpus(small, allowed=range(8)) == 1
    assert available_cpus(small, allowed=range(8)) == 1


def test_no_quota_leaves_the_counts(tmp_path: Path) -> None:
    root = _machine(tmp_path, SMT_4X2, quota="max 100000")
    assert math_cpus(root, allowed=range(8)) == 4


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root = _machine(tmp_path, {0: "0", 1: "1", 2: "2", 3: "3"})
    (root / "fs/cgroup/cpu").mkdir(parents=True)
    (root / "fs/cgroup/cpu/cpu.cfs_quota_us").write_text("300000\n")
    (root / "fs/cgroup/cpu/cpu.cfs_period_us").write_text("100000\n")
    assert math_cpus(root, allowed=range(4)) == 3
    (root / "fs/cgroup/cpu/cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert math_cpus(root, allowed=range(4)) == 4


def test_efficiency_cores_are_left_out(tmp_path: Path) -> None:
    # 6 performance cores of two threads (0-11), 8 efficiency cores of one (12-19)
    siblings = {cpu: f"{cpu - cpu % 2},{cpu - cpu % 2 + 1}" for cpu in range(12)} | {cpu: str(cpu) for cpu in range(12, 20)}
    root = _machine(tmp_path, siblings)
    (root / "devices/cpu_core").mkdir(parents=True)
    (root / "devices/cpu_core/cpus").write_text("0-11\n")
    (root / "devices/cpu_atom").mkdir(parents=True)
    (root / "devices/cpu_atom/cpus").write_text("12-19\n")
    assert math_cpus(root, allowed=range(20)) == 6
    assert available_cpus(root, allowed=range(20)) == 20
    assert math_cpus(root, allowed={0, 1, 12, 13}) == 1
    assert math_cpus(root, allowed={12, 13, 14}) == 3  # only efficiency cores: they are what there is


def test_an_unreadable_hybrid_list_leaves_every_core(tmp_path: Path) -> None:
    root = _machine(tmp_path, {0: "0", 1: "1", 2: "2"})
    (root / "devices/cpu_core").mkdir(parents=True)
    (root / "devices/cpu_core/cpus").write_text("0-1\n")
    (root / "devices/cpu_atom").mkdir(parents=True)
    (root / "devices/cpu_atom/cpus").write_text("two\n")
    assert math_cpus(root, allowed=range(3)) == 3

