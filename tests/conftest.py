"""Session-wide isolation: every checkpoint-store daemon started by any test (directly, or inside a
training subprocess through mindio.save) uses a private runtime directory and a small pool, and is
stopped when the session ends. Without this, each would reserve the default pool (a quarter of RAM)
under /tmp/mindio-acp-<uid> and linger until its idle timeout. Logs go to a temporary directory."""
import os
import shutil
import tempfile

_SESSION_ACP_DIR = tempfile.mkdtemp(prefix="mindio-test-acp-", dir="/tmp")
_SESSION_LOG_DIR = tempfile.mkdtemp(prefix="mindio-test-logs-", dir="/tmp")
os.environ.setdefault("MINDIO_ACP_DIR", _SESSION_ACP_DIR)
os.environ.setdefault("MINDIO_ACP_POOL_MB", "512")
os.environ.setdefault("MINDIO_ACP_IDLE_EXIT", "30")
os.environ.setdefault("TTP_LOG_PATH", _SESSION_LOG_DIR)


# One fork-server host per test process (mindio/launch/_zygote_host.py, MINDIO_FORK_SERVER_HOST): the
# suite launches ~250 mindio-run agents, each of which would start a fork server that imports torch,
# torch._dynamo and megatron-core again (~2.9 CPU-s each); the host forks them warm. A launch whose
# environment differs from the host's in what imports read (PYTHONPATH, TORCH_*, ...), or that runs in
# another network namespace, is refused and starts its own, as without the host. MINDIO_TEST_FORK_SERVER_HOST=0:
# no host (every agent starts its own fork server, as a user's job does).
_HOST = None


def _start_fork_server_host() -> None:
    global _HOST
    if os.environ.get("MINDIO_TEST_FORK_SERVER_HOST", "1") == "0" or os.environ.get("MINDIO_FORK_SERVER_HOST"):
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = tempfile.mkdtemp(prefix="mindio-test-host-", dir="/tmp")  # 0700
    path = os.path.join(d, "host.sock")
    log_dir = os.environ.get("MINDIO_TEST_HOST_LOG_DIR", _SESSION_LOG_DIR)  # its lines: each fork, each refusal
    log = open(os.path.join(log_dir, f"fork-server-host-{os.getpid()}.log"), "ab")
    from mindio.launch import _zygote_host

    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1"}
    _HOST = _zygote_host.spawn(path, log, env=env, cwd=repo)
    log.close()
    if _HOST is None:  # the suite runs without it (each agent starts its own fork server)
        return
    os.environ["MINDIO_FORK_SERVER_HOST"] = path
    os.environ["_MINDIO_TEST_HOST_DIR"] = d


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the xdist controller runs no test
    _start_fork_server_host()


def pytest_sessionfinish(session, exitstatus):
    from tests.acp.conftest import stop_daemon

    if _HOST is not None:
        _HOST.kill()  # its branches and idle fork servers die with it (PR_SET_PDEATHSIG)
        _HOST.wait()
        shutil.rmtree(os.environ.pop("_MINDIO_TEST_HOST_DIR", ""), ignore_errors=True)
        os.environ.pop("MINDIO_FORK_SERVER_HOST", None)
    stop_daemon(_SESSION_ACP_DIR)
    shutil.rmtree(_SESSION_ACP_DIR, ignore_errors=True)
    shutil.rmtree(_SESSION_LOG_DIR, ignore_errors=True)


# Hypothesis' per-example deadline is a timing assertion; on a shared 2-core machine a single
# example can stall for a second. Speed is measured by bench/, correctness by the properties.
from hypothesis import settings as _hyp_settings

_hyp_settings.register_profile("mindio", deadline=None)
_hyp_settings.load_profile("mindio")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def fault_free_run(tmp_path_factory):
    """The fault-free reference runs, each done once per session: several e2e tests (and each of their
    parametrizations) compare a faulty run's digest with the same uninterrupted run.

    ``fault_free_run(key, run)`` returns ``run(directory)`` (a fresh directory) the first time ``key``
    is asked for, and that same result afterwards. ``key`` must name everything the run's result can
    depend on: the script, the exact argument list, the launcher and every environment variable the
    caller sets other than output paths (two runs are shared only when these are equal). A run that
    raises is not cached: the next test asking for it runs it again (and fails the same way)."""
    done: dict = {}

    def get(key, run):
        if key not in done:
            done[key] = run(tmp_path_factory.mktemp("fault-free"))
        return done[key]

    return get


# pytest-xdist (scripts/test.sh runs the suite on 3 workers, --dist loadgroup): the tests of one module run
# on one worker, so that a module-scoped fixture runs once; modules that compare against the same
# fault-free reference run (``fault_free_run`` keys) form one group, so that it runs once too.
# The groups are made by the scheduler below from the test ids: pytest-xdist 3.8 turns an
# ``xdist_group`` mark into a suffix of ``item._nodeid``, which pytest 9 no longer reads (its node ids
# live in ``item._id``), so marks alone would group nothing.
_SHARE_A_REFERENCE = {
    "tests/megatron/test_elastic_megatron.py": "layout-references",  # layout_reference (tests/megatron/_mgt_launch.py)
    "tests/megatron/test_layouts_megatron.py": "layout-references",
    "tests/megatron/test_retry_megatron.py": "megatron-ha-references",  # ha_reference (tests/megatron/_mgt_launch.py)
    "tests/recovery/test_recover_megatron.py": "megatron-ha-references",
    "tests/recovery/test_recover_inplace.py": "toy-under-mindio-run",  # fault_free_digest
    "tests/recovery/test_recover_node.py": "toy-under-mindio-run",
    "tests/recovery/test_etcd_store.py": "toy-under-mindio-run",
    "tests/launch/test_launch_ha.py": "toy-under-mindio-run",
    "tests/recovery/test_network_faults.py": "toy-under-mindio-run",
    "tests/dropin/test_plain_loop.py": "plain-loop",  # reference (tests/dropin/test_plain_loop.py)
    "tests/launch/test_preempt.py": "plain-loop",
    "tests/ttp/test_dump_e2e.py": "ttp-toy",  # fault_free_state (tests/ttp/_harness.py)
    "tests/ttp/test_negotiation_e2e.py": "ttp-toy",
    "tests/ttp/test_pause_e2e.py": "ttp-toy",
}


def _group_of(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return _SHARE_A_REFERENCE.get(module, module)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist not installed: the suite runs in one process (a hook it does not know fails)
    pass
else:
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "loadgroup":
            return None

        class ByGroup(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _group_of(nodeid)

            def _reschedule(self, node) -> None:
                # A worker gets its next group when it holds the last test of its groups (it waits for the
                # test after it before running it: pytest's nextitem): none of its time is lost. xdist's
                # own threshold (2) hands the group over one test earlier -- a whole Megatron test -- so
                # that near the end a group could wait behind that test on one worker while the other
                # worker, done, idled until the end of the suite.
                if node.shutting_down:
                    return
                if not self.workqueue:
                    node.shutdown()
                    return
                if self._pending_of(self.assigned_work[node]) <= 1:
                    self._assign_work_unit(node)

        return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # set in each xdist worker under --dist loadgroup
        # the groups go to the workers in this order (scripts/test.sh passes --no-loadscope-reorder): the
        # heaviest first (multi-process tests; the Megatron ones weigh most), the many quick ones last, so
        # that both workers end together instead of one finishing a long group alone
        weight: dict = {}
        for item in items:
            w = 4 if item.get_closest_marker("megatron") else 1 if item.get_closest_marker("slow") else 0.02
            weight[_group_of(item.nodeid)] = weight.get(_group_of(item.nodeid), 0) + w
        first = {g: i for i, g in reversed(list(enumerate(_group_of(item.nodeid) for item in items)))}
        items.sort(key=lambda item: (-weight[_group_of(item.nodeid)], first[_group_of(item.nodeid)]))
