"""mindio/megatron/regroup.py: a retry keeps the model and swaps its process groups (one gloo rank in its
own process, _regroup_worker.py). Groups held as attributes, in dataclasses, named tuples, lists,
dicts and slots are unplugged -- nothing keeps a destroyed group alive, so peers are released -- and the
new generation's groups of the same ranks and description are plugged in and work; a group held where
the walk cannot reach (a closure) is reported, so the adapter drops the model instead; a new layout
without a counterpart is named; a build's collectives are recorded and run again."""
import subprocess
import sys

import pytest

from mindio._ports import free_port
from _mgt_launch import REPO, SLOW_MEGATRON

pytestmark = SLOW_MEGATRON

WORKER = REPO / "tests" / "megatron" / "_regroup_worker.py"


def run(case: str) -> str:
    proc = subprocess.run([sys.executable, "-W", "ignore", str(WORKER), case, str(free_port())],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.timeout(90)
def test_groups_are_unplugged_released_and_the_new_ones_plugged_in():
    assert "plugged: ok" in run("plug")


@pytest.mark.timeout(90)
def test_a_group_held_by_a_closure_is_reported():
    assert "closure held: found" in run("closure")


@pytest.mark.timeout(90)
def test_a_socket_without_a_new_group_of_its_ranks_is_named():
    assert "layout: missing named" in run("layout")


@pytest.mark.timeout(90)
def test_a_builds_collectives_are_recorded_and_run_again_on_the_new_groups():
    """What a rank keeping its model runs instead of its build (a replacement's build meets it): the
    object collectives and barriers, on the new group of the same ranks; a tensor collective is the
    reason given for building again."""
    assert "replay: ok" in run("replay")
