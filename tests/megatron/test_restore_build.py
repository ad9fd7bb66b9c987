"""A recovery's builds skip megatron's weight initialisation only where the rollback restores every
param, and take the previous build's grad buffers again (mindio/megatron/restore_build.py): 2 gloo
ranks; the params after the rollback are bitwise those of a full build."""

import re

import pytest

from _mgt_launch import REFERENCE_LAUNCHER, REPO, torchrun, SLOW_MEGATRON

pytestmark = SLOW_MEGATRON

WORKER = REPO / "tests" / "megatron" / "_restore_build_worker.py"
# the launcher is not what these runs test: mindio-run's fork server imports torch and megatron-core once for
# both ranks (_mgt_launch.reference_run), where torchrun would import them in each
LAUNCH = REFERENCE_LAUNCHER


def draws(out: str) -> tuple:
    m = re.search(r"draws full=(\d+) restore=(\d+)", out)
    assert m, out[-3000:]
    return int(m.group(1)), int(m.group(2))


@pytest.mark.timeout(150)
def test_trainable_model_is_built_without_initialisation():
    out = torchrun(WORKER, ["trainable"], nproc=2, timeout=120, launcher=LAUNCH)
    full, restore = draws(out)
    assert full > 0 and restore == 0, out[-3000:]
    # the previous build's grad buffer (one: fp32 params, one dtype) is the new build's memory again
    assert out.count("spare buffers taken again: 1 of 1") == 2, out[-3000:]
    assert out.count("params after rollback equal to the full build: True") == 2, out[-3000:]


@pytest.mark.timeout(150)
def test_frozen_param_builds_again_in_full():
    out = torchrun(WORKER, ["frozen"], nproc=2, timeout=120, launcher=LAUNCH)
    full, restore = draws(out)
    assert restore == full > 0, out[-3000:]  # the uninitialised build was dropped, the second drew all
    assert "building again with the weight initialisation" in out, out[-3000:]
    assert out.count("params after rollback equal to the full build: True") == 2, out[-3000:]
