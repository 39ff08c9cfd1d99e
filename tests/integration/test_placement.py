"""Placement on a Ray cluster never hangs (tandem/deploy/resources.py, launcher.launch): a
deployment the cluster cannot hold is refused before anything is placed, and workers that
cannot be placed in time (another holder has the CPUs) fail the launch within
`placement.timeout_s`, naming what is missing, with every placement group and actor released.
Both on a real local Ray instance of 2 CPUs. As a Ray job on a `ray start` cluster:
tests/integration/test_ray_job.py."""

from __future__ import annotations

import time

import pytest

from disagg_helpers import tiny_model_and_head

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_2cpu():
    from tandem.deploy.launcher import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


def config(dirs, *, decode_cpus: float = 1.0, timeout_s: float = 30.0):
    from tandem.deploy.config import DeployConfig, GroupConfig, PlacementConfig
    from tandem.engine import EngineConfig
    from tandem.spec import SpecConfig

    model_dir, head_dir = dirs
    return DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=64),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=2),
        prefill=GroupConfig(num_cpus=1.0), decode=GroupConfig(num_cpus=decode_cpus),
        placement=PlacementConfig(timeout_s=timeout_s))


def tandem_groups_left() -> list[str]:
    return [f"{pg['name']}:{pg['state']}" for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith("tandem-") and pg["state"] != "REMOVED"]


def wait_all_cpus_free(timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"CPUs still held: {ray.available_resources()}"
        time.sleep(0.2)


def test_a_deployment_the_cluster_cannot_hold_is_refused_at_once(ray_2cpu, dirs):
    from tandem.deploy.launcher import launch
    from tandem.deploy.resources import PlacementError

    t0 = time.monotonic()
    with pytest.raises(PlacementError) as err:
        launch(config(dirs, decode_cpus=4.0))
    assert time.monotonic() - t0 < 5
    assert "needs 5 CPU in all (prefill-0 1, decode-0 4)" in str(err.value)
    assert "prefill.num_cpus / decode.num_cpus" in str(err.value)
    assert tandem_groups_left() == []
    wait_all_cpus_free(timeout_s=1)


def test_workers_not_placed_in_time_fail_the_launch_and_release_everything(ray_2cpu, dirs):
    from tandem.deploy.launcher import launch
    from tandem.deploy.resources import PlacementError

    hog = ray.util.placement_group([{"CPU": 1.5}], name="someone-else")  # leaves 0.5 CPU
    assert hog.wait(30)
    try:
        t0 = time.monotonic()
        with pytest.raises(PlacementError) as err:
            launch(config(dirs, timeout_s=2.0))  # fits the cluster, not what is free now
        assert time.monotonic() - t0 < 15
        msg = str(err.value)
        assert msg.startswith("placement.timeout_s: not placed within 2 s")
        assert "prefill-0 (1 x 1 CPU)" in msg and "decode-0 (1 x 1 CPU)" in msg
        assert "0.5 CPU free" in msg
        assert tandem_groups_left() == []
    finally:
        ray.util.remove_placement_group(hog)
    wait_all_cpus_free()
    # ... and the same deployment starts once the CPUs are free.
    from tandem.deploy.launcher import launch as launch_again

    dep = launch_again(config(dirs))
    try:
        assert set(dep.prefill) == {"prefill-0"} and set(dep.decode) == {"decode-0"}
    finally:
        dep.shutdown()
    assert tandem_groups_left() == []
