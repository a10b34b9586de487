"""``-n N --device cuda``: each pytest-xdist worker gets its own GPU (worker gwI → cuda:(I mod GPUs))."""

import pytest

from kvqbench.plugin.options import worker_device


@pytest.mark.parametrize("workerid,count,expected", [
    ("gw0", 4, "cuda:0"), ("gw3", 4, "cuda:3"), ("gw5", 4, "cuda:1"), ("gw1", 1, "cuda:0"),
])
def test_workers_round_robin_over_the_gpus(workerid, count, expected):
    assert worker_device("cuda", workerid, count) == expected


def test_every_gpu_gets_a_worker_and_none_gets_two_when_workers_equal_gpus():
    devices = [worker_device("cuda", f"gw{i}", 8) for i in range(8)]
    assert sorted(devices) == sorted(f"cuda:{i}" for i in range(8))


@pytest.mark.parametrize("dev,workerid", [
    ("cuda:1", "gw0"),  # an explicit device is kept
    ("cpu", "gw2"),
    ("cuda", None),  # not an xdist worker (serial run, controller)
    ("cuda", "master"),
])
def test_explicit_devices_and_non_workers_are_kept(dev, workerid):
    assert worker_device(dev, workerid, 4) == dev


def test_auto_device_without_a_gpu_driver_is_cpu_without_torch_doubt():
    """Where the torch-free driver check says "no GPU", torch agrees, and --device auto is cpu."""
    from kvqbench.plugin import options as plugin

    if not plugin._no_gpu_driver():
        pytest.skip("a GPU driver is present here: auto resolves through torch")
    import torch

    assert not torch.cuda.is_available()
    assert plugin._resolve_device("auto") == "cpu"


def test_torch_version_from_metadata_is_torch_version():
    """The controller's provenance reads torch's version from the package metadata: the same string."""
    from importlib.metadata import version

    import torch

    assert version("torch") == str(torch.__version__)
