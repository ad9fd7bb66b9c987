"""Every environment variable mindio reads: name, type, default, range and meaning, in one place.

Read a value with ``knobs.get("TTP_LOG_LEVEL")``; a malformed or out-of-range value raises
:class:`mindio.errors.ConfigError` naming the variable, the bad value and the allowed range.
``python -m mindio._knobs`` prints the table: first the settings a user may set, then the variables
``mindio-run`` / torchrun set for their workers (``internal``: read, never to be set by hand).
tests/unit/test_knobs.py checks that every variable read in mindio/ is declared here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ConfigError
from .vocab import HA_STRATEGIES


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 0/1/true/false")


@dataclass(frozen=True)
class Knob:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    internal: bool = False  # set by the launcher for its workers (mindio-run or torchrun), not by a user

    def read(self, environ=None) -> Any:
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            value = self.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{self.name}={raw!r} is not valid ({exc}); {self.allowed()}") from None
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{self.name}={raw!r} is not valid; {self.allowed()}")
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise ConfigError(f"{self.name}={raw!r} is out of range; {self.allowed()}")
        return value

    def allowed(self) -> str:
        if self.choices is not None:
            return f"allowed: {', '.join(map(str, self.choices))} (default {self.default!r})"
        if self.min is not None or self.max is not None:
            return f"allowed: [{self.min}, {self.max}] (default {self.default!r})"
        return f"default {self.default!r}"


def _upper(text: str) -> str:
    return text.strip().upper()


def _signals(text: str) -> tuple:
    """A comma list of signal names (``SIGTERM,SIGUSR1``; ``TERM`` is read as ``SIGTERM``); ``none``: ()."""
    import signal

    if text.strip().lower() in ("none", "off", "0"):
        return ()
    names = tuple(n if n.startswith("SIG") else "SIG" + n for n in (s.strip().upper() for s in text.split(",")) if n)
    bad = [n for n in names if not isinstance(getattr(signal, n, None), signal.Signals) or n in ("SIGKILL", "SIGSTOP")]
    if bad:
        raise ValueError(f"{bad} not a signal that can be handled; use e.g. SIGTERM,SIGUSR1 or none")
    return names


def _ha_list(text: str) -> tuple:
    allowed = set(HA_STRATEGIES)
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in items if s not in allowed]
    if bad:
        raise ValueError(f"unknown strategies {bad}; use a comma list of {sorted(allowed)}")
    return items


_ALL = [
    # --- logging (reference names) ---
    Knob("TTP_LOG_PATH", str, "",
         "Directory for mindio's log files (ttp_log.log[.<pid>], every line at TTP_LOG_LEVEL); empty: no "
         "file, WARNING and above go to stderr only. (The reference's default is 'logs'.)"),
    Knob("TTP_LOG_LEVEL", _upper, "INFO", "Level of the log file (and of stderr with TTP_LOG_STDOUT=1).",
         choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    Knob("TTP_LOG_MODE", _upper, "PER_PROC",
         "ONLY_ONE: all processes write one log; PER_PROC: one file per process (ttp_log.log.<pid>).",
         choices=("ONLY_ONE", "PER_PROC")),
    Knob("TTP_LOG_STDOUT", _bool, False, "1: every line at TTP_LOG_LEVEL to stderr, no log file."),
    Knob("MINDIO_EVENT_LOG", str, "",
         "Path of a JSON-lines event log (fault seen, transitions, actions and durations); empty: off."),
    # --- control plane ---
    Knob("MINDIO_STATUS_PORT", int, 0,
         "Port of the controller's status and metrics server (GET /status for `mindio status`, GET /metrics "
         "for Prometheus) on the controller's address; 0: none (mindio/ttp/controller/status.py).", min=0, max=65535),
    Knob("MINDIO_STATUS_ADDR", str, "",
         "host:port of a job's status server, for `mindio status` (default: TTP_ADDR or 127.0.0.1, and "
         "MINDIO_STATUS_PORT)."),
    Knob("TTP_RETRY_TIMES", int, 10, "Processor connection attempts to a controller.", min=1, max=300),
    Knob("MINDIO_CONTROLLER_WAIT", float, 30.0,
         "Seconds a processor started without MINDIO_SECRET waits for the controller's rank to publish the job "
         "secret in the job's torch.distributed store; then it fails naming the controller address.",
         min=1, max=3600),
    Knob("MINDIO_CONTROLLER_LOST_EXIT", float, 30.0,
         "Seconds a rank parked after a fault (tft_wait_next_action) waits with no controller reachable before "
         "it exits with EXIT_CODE_FAULT.", min=1, max=3600),
    Knob("MINDIO_CONTROLLER_EXIT_WAIT", float, 30.0,
         "Seconds a process that hosts the controller waits, after an EXIT, for the controller's exit order to "
         "reach every rank before it leaves.", min=1, max=3600),
    Knob("MINDIO_EXIT_ORDER_WAIT", float, 60.0,
         "Seconds a rank's main thread has to carry out the controller's exit order (at its next fence, "
         "tft_start_updating_os / tft_pause_train, or parked in tft_exception_handler); then the processor ends "
         "the process with the order's code, logging where the main thread was (outside train(), or blocked "
         "where no fence comes).", min=1, max=3600),
    Knob("TTP_NORMAL_ACTION_TIME_LIMIT", float, 180.0,
         "Seconds the controller waits for replies to one recovery action.", min=30, max=1800),
    Knob("MINDIO_WAIT_MINDX_TIME", float, 30.0,
         "Seconds the controller waits for the cluster brain's answer.", min=1, max=3600),
    Knob("MINDIO_SWITCH_PRESTART", _bool, True,
         "Hot switch: 1 starts the backups and waits for their registration before pausing the job (their start "
         "runs while training goes on); 0 starts them after the pause (the former order; kept to measure it)."),
    Knob("TTP_STOP_CLEAN_BEFORE_DUMP", _bool, False, "Run stop & clean before a last-words dump."),
    Knob("TTP_ADDR", str, "", "Controller address for processors (falls back to CONTROLLER_ADDR, MASTER_ADDR)."),
    Knob("CONTROLLER_ADDR", str, "", "Controller address (alias of TTP_ADDR)."),
    Knob("PROCESSOR_ADDR", str, "", "Local address a processor binds/advertises."),
    Knob("TTP_PORT", int, 8000, "Controller port.", min=1024, max=65535),
    Knob("MINDIO_HEARTBEAT_INTERVAL", float, 1.0, "Seconds between heartbeats.", min=0.05, max=60),
    Knob("MINDIO_HEARTBEAT_MISSES", int, 3,
         "Missed heartbeats after which a rank is dead; MISSES x INTERVAL is the outage tolerance, also of the "
         "launcher's node-loss check (at least 3 s). TCP retransmits a lost beat 0.2, 0.6, 1.4, 3.0, 6.2 s after "
         "it was sent, so a single outage up to the largest of those below (MISSES - 1) x INTERVAL is always "
         "ridden out: 1.4 s with the defaults; docs/recovery.md, Outage tolerance.", min=1, max=100),
    Knob("MINDIO_HANG_TIMEOUT", float, 300.0,
         "Seconds without step progress after which a rank that never entered the collective its peers wait "
         "in (or, without that evidence, whose main thread is outside a collective) is declared hung and "
         "SIGKILLed; 0: off. Set, it is the bound; unset, the bound comes from the job itself after "
         "MINDIO_HANG_MIN_STEPS steps: max(MINDIO_HANG_FLOOR, MINDIO_HANG_K x p99 step time), this value "
         "before.", min=0, max=86400),
    Knob("MINDIO_HANG_MIN_STEPS", int, 20,
         "Steps each rank must have timed before the hang bound comes from the job's step times "
         "(MINDIO_HANG_TIMEOUT unset).", min=2, max=100000),
    Knob("MINDIO_HANG_K", float, 5.0,
         "The job's hang bound is this many times its p99 step time (at least MINDIO_HANG_FLOOR; "
         "MINDIO_HANG_TIMEOUT unset).", min=1.5, max=1000),
    Knob("MINDIO_SLOW_WINDOW", int, 0,
         "Steps per slow-rank scoring window (controller/slow.py; docs/recovery.md, Slow ranks); 0: off.",
         min=0, max=100000),
    Knob("MINDIO_SLOW_RATIO", float, 1.2,
         "A rank is slow when its own time per step (its step's wall time less the time its main thread "
         "waited: compute, or stopped/throttled from outside) is at least this many times its peers' median "
         "(and its peers wait for it: MINDIO_SLOW_MIN_WAIT); a process group's communication is slow when each "
         "member waits in its collectives at least this many times the group's floor.", min=1.05, max=1000),
    Knob("MINDIO_SLOW_MIN_WAIT", float, 0.1,
         "A slow rank's peers must wait (per step) at least this share of its step time more than it does; a "
         "slow group's members, this share of a step more than its floor.",
         min=0.0, max=1.0),
    Knob("MINDIO_SLOW_ACTION", str, "report",
         "What the controller does with a rank named slow (MINDIO_SLOW_WINDOW > 0): report it only, or switch "
         "it to a new process with a hot switch (needs mindio-run --high-availability and a warm spare, "
         "--standby; a cluster brain, if attached, decides at the pause as for any hot switch).",
         choices=("report", "switch")),
    Knob("MINDIO_SLOW_HZ", float, 0.0,
         "Ticks per second of each rank's wait clock (processor/waitclock.py) while slow ranks are scored "
         "(MINDIO_SLOW_WINDOW > 0); 0: 25 where the kernel keeps each thread's run-queue delay "
         "(/proc/<pid>/task/<tid>/schedstat: the wait is exact at any rate, a stop shorter than a tick is seen "
         "in part), else 100 (a tick that comes late counts as the rank's own time).",
         min=0, max=1000),
    Knob("MINDIO_SLOW_K", int, 3,
         "Windows in a row a rank must score slow before rank_slow is reported.", min=1, max=1000),
    Knob("MINDIO_HANG_FLOOR", float, 1.0,
         "Seconds: the least hang bound derived from the job's step times (MINDIO_HANG_TIMEOUT unset); raise "
         "it above the longest irregular step the job has (a checkpoint save between steps), or set "
         "MINDIO_HANG_TIMEOUT.", min=0.2, max=86400),
    Knob("MINDIO_STOP_STUCK_S", float, 10.0,
         "With recover-in-place enabled: seconds ranks may keep running after every other rank stopped and "
         "tore its groups down; then the ones outside a collective (else all) are SIGKILLed and replaced like "
         "dead ranks, and the rest get the window again; 0: they get the full stop timeout.", min=0, max=3600),
    Knob("MINDIO_PID_PROBE", _bool, True,
         "1: the controller also watches the processes of ranks on its own host (pidfd) and declares a rank "
         "dead the moment its process exits without BYE; 0: heartbeats only (docs/ttp.md)."),
    Knob("MINDIO_NCCL_ABORT_TIMEOUT", float, 30.0,
         "Seconds a rank's teardown waits for the abort of its NCCL communicators (all at once, one thread "
         "each: ncclCommAbort takes about 1 s per communicator); past it the teardown goes on without them and "
         "logs the groups still aborting.", min=1, max=600),
    Knob("MINDIO_ETCD_RETRY", float, 10.0,
         "--rdzv-backend etcd: seconds an agent keeps asking again when etcd answers a request with a transient "
         "error (its raft could not commit in time: 'Raft Internal Error: request timed out', a leader election) or "
         "the connection fails; only requests that may be repeated are (reads, sets, the create-if-absent forms, "
         "read back first); past it the error stands and the agent ends its job as for a lost store.", min=0, max=600),
    Knob("MINDIO_GC_FREEZE", _bool, True,
         "1: freeze the objects that exist before the model is built (gc.freeze, once) so that the garbage "
         "collection of a recovery teardown walks only the training objects (docs/recovery.md); and at process "
         "exit, after one collection, freeze the rest so that the interpreter's shutdown collections skip it "
         "(mindio/ttp/shutdown.py); mindio-run's fork server freezes what its imports created before it forks a "
         "worker (mindio/launch/_zygote.py); 0: off."),
    Knob("MINDIO_FAST_EXIT", _bool, True,
         "1: after an EXIT ordered by the controller (e.g. after a dump), end the process with os._exit once "
         "the framework's atexit handlers ran, skipping the interpreter teardown (seconds); 0: full teardown."),
    Knob("MINDIO_EXIT_TIMEOUT", float, 10.0,
         "Seconds the exit teardown (mindio/ttp/shutdown.py) waits in all for mindio's control-plane threads "
         "to end and for the process groups it destroys to release their worker threads, before the "
         "interpreter shuts down.", min=0.1, max=600),
    Knob("MINDIO_SECRET", str, "",
         "Per-job secret that signs control messages (>= 16 characters; the same on every rank). mindio-run "
         "sets it for its workers; empty: MINDIO_SECRET_FILE, else the controller's rank generates one and "
         "publishes it in the job's torch.distributed store, readable by anyone who reaches that port (logged "
         "once; docs/security.md)."),
    Knob("MINDIO_SECRET_FILE", str, "",
         "File holding the job secret (a regular file of your own uid with no group/other access, e.g. mode "
         "0600; a symlink is refused), used when MINDIO_SECRET is empty; also how mindio-run agents on "
         "several nodes share one secret without the open store."),
    Knob("MINDIO_BACKUP_CONTROLLERS", int, 0,
         "How many backup controllers (start_backup_controller) the primary accepts; each is advertised to "
         "every processor. 0: none (a backup's registration is refused and logged). Under mindio-run "
         "--high-availability on 2+ nodes: nodes 1..N's agents each host one, which saves a last-words "
         "checkpoint when node 0 is lost, or with a standby takes the job over; unset: 1 -- with the agents on "
         "etcd (--rdzv-backend etcd, whose leader key settles a partition) a full one, on node 0's TCPStore, "
         "where a node cut off from node 0 cannot tell that from node 0's loss, a provisional one: its "
         "checkpoint is never made the latest (mindio.megatron writes it under <save>/mindio-provisional; "
         "other save handlers where they write, their rename handler not run; mindio/launch/backup.py). "
         "Set (1, 2) on the TCPStore: full backups, whose checkpoint is the latest.", min=0, max=2),
    Knob("MINDIO_RELAYS", _bool, True,
         "1 (default): under mindio-run --high-availability each node agent relays its ranks' control traffic "
         "(one authenticated connection per node carrying their beats, reports and acknowledgements; "
         "mindio/ttp/wire/relay.py), and a controller accepts relays; 0: every rank connects to the controller "
         "itself, and a controller refuses relays."),
    Knob("MINDIO_RELAY_ADDR", str, "",
         "Set by mindio-run for its workers: the IPC address of their node agent's relay (MINDIO_RELAYS).",
         internal=True),
    Knob("HIGH_AVAILABILITY", _ha_list, (),
         "Comma list of strategies to enable (the job's recover-strategy list): dump, retry, recover, "
         "recover-in-place, elastic-training, exit."),
    Knob("MINDIO_FAULT_TABLE", str, "",
         "JSON file overlaying the built-in fault table (levels, faults, patterns, frequency, duration, "
         "recover_strategy; docs/ttp.md); empty: the built-in table mindio/ttp/fault_table.json."),
    Knob("MINDIO_CONTROLLER_EXTERNAL", _bool, False,
         "1: the launcher hosts the controller; the example training scripts start none in rank 0."),
    Knob("MINDIO_DECISION_TIMEOUT", float, 300.0,
         "mindio-run with --high-availability: seconds a worker death may wait for the controller's decision "
         "(replace the rank, or end the job) before the agent fails the round anyway.", min=1, max=86400),
    Knob("MINDIO_PREEMPT_SIGNAL", _signals, ("SIGTERM",),
         "Signals that mean preemption (comma list, e.g. SIGTERM,SIGUSR1; none: off). mindio-run, or a worker "
         "whose processor started (tft_start_processor), that receives one asks the controller for a last-words "
         "checkpoint at the current step; the workers then exit with EXIT_CODE_DUMPED (75), and so does "
         "mindio-run (docs/recovery.md, Preemption). mindio-run: --preempt-signal."),
    Knob("MINDIO_PREEMPT_TIMEOUT", float, 20.0,
         "Seconds from a preemption signal to the end of the last-words checkpoint and of every worker; past it "
         "mindio-run stops its workers as for any other signal (--shutdown-timeout later SIGKILL), and a worker "
         "still running ends itself by the signal. 20 s plus the 3 s shutdown timeout fit a 30 s grace period "
         "(Kubernetes' default, Slurm's KillWait). mindio-run: --preempt-timeout.", min=1, max=3600),
    Knob("MINDIO_FORK_SERVER", str, "auto",
         "mindio-run: auto: each agent forks its workers from one warm interpreter (the imports paid once per "
         "node, not once per worker), where a fork is safe: OMP_NUM_THREADS=1 (the default with several workers a "
         "node), torch built for the CPU only (a CUDA/ROCm/XPU build "
         "or torch_npu: every worker is exec'd), and the server runs one thread and no CUDA after its imports; "
         "off: every worker is an exec'd warm spare (mindio/launch/forkserver.py).", choices=("auto", "off")),
    Knob("MINDIO_FORK_SERVER_HOST", str, "",
         "mindio-run: path of a fork-server host's socket (python -m mindio.launch._zygote_host PATH, in a private "
         "directory): the agent's fork server is forked by that host, whose imports are done, instead of started "
         "(~3 CPU-s less per launch; for a suite or CI job that launches many jobs in a row). Refused, and the agent "
         "starts its own, when the host differs in user, interpreter, namespaces or import-time environment "
         "(mindio/launch/_zygote_host.py)."),
    Knob("PYTHONPATH", str, "",
         "Python's module path (Python's, not mindio's); read by a fork-server host (MINDIO_FORK_SERVER_HOST) to build an "
         "agent's sys.path: it forks for the agent only where that finds every module it imported in the same place."),
    Knob("MINDIO_FORK_SERVER_TIMEOUT", float, 300.0,
         "mindio-run: seconds an agent waits for its fork server to finish its imports, then for each fork.",
         min=1, max=3600),
    Knob("OMP_NUM_THREADS", str, "",
         "OpenMP/BLAS threads of each worker (torch's, not mindio's); mindio-run sets 1 with several workers a node, "
         "as torchrun does. mindio-run forks its workers from a fork server only when it is 1 (MINDIO_FORK_SERVER)."),
    Knob("MINDIO_PRELOAD", str, "",
         "mindio-run: comma list of extra modules its warm worker interpreters import before they know their "
         "rank (only modules that read no rank variable at import; torch, numpy, megatron.core and mindio "
         "always are)."),
    Knob("MINDIO_STANDBY", _bool, False,
         "1: this process is a standby for a rank an elastic downgrade removed (the example training scripts "
         "register it with the controller and wait for the scale-out; docs/elastic.md)."),
    Knob("MINDIO_DUMP_AFTER_UPGRADE", _bool, False,
         "1: the controller writes a checkpoint (save + rename) right after an elastic scale-out, before "
         "training goes on (docs/elastic.md)."),
    # --- checkpoint store ---
    Knob("MINDIO_ACP_DIR", str, "",
         "Runtime directory of the per-user acp daemon (socket, lock, journal); default $XDG_RUNTIME_DIR/mindio-acp "
         "when XDG_RUNTIME_DIR is set, else /tmp/mindio-acp-<uid>. Created 0700; refused unless private to you."),
    Knob("XDG_RUNTIME_DIR", str, "",
         "Standard per-user runtime directory (set by systemd-logind); the acp runtime directory defaults to "
         "$XDG_RUNTIME_DIR/mindio-acp when set."),
    Knob("MINDIO_ACP_IDLE_EXIT", float, 600.0,
         "Seconds an idle daemon with nothing to persist waits before exiting.", min=1, max=86400),
    Knob("MINDIO_ACP_LOAD_VIEW", _bool, True,
         "1: each trainer maps the pool a second time, copy-on-write, pre-faulted in the background, so loads "
         "are zero-copy with no page faults (costs page tables + ~0.4 CPU-s per GiB of pool per process); "
         "0: each load maps its region afresh."),
    Knob("MINDIO_ACP_PIN_POOL", _bool, True,
         "1: a process that saves or loads CUDA/NPU tensors registers its mapping of the pool as page-locked "
         "memory once (at connect when CUDA/NPU is already in use, else at its first device copy), so device "
         "copies are DMA straight into/out of the pool; the whole pool stays pinned while the process lives "
         "(docs/acp.md, GPU state); 0: device copies go through two reusable 64 MiB pinned staging buffers "
         "per device."),
    Knob("MINDIO_ACP_DISABLE", _bool, False, "1: never use the daemon; save writes directly to storage."),
    Knob("MINDIO_ACP_POOL_MB", int, 0,
         "Pool size in MiB for a daemon this process starts (0: from server_info; small values for tests).",
         min=0, max=1 << 20),
    Knob("MINDIO_ACP_PERSIST_RETRIES", int, 3,
         "Attempts to persist one checkpoint before it counts as a storage failure.", min=1, max=100),
    Knob("MINDIO_ACP_UNSERVICEABLE_AFTER", int, 3,
         "Consecutive storage failures after which the daemon is unserviceable and clients fall back.",
         min=1, max=1000),
    Knob("MINDIO_ACP_PERSIST_DELAY", float, 0.0,
         "Seconds a daemon worker waits before persisting each file (tests and demos of crash windows).",
         min=0, max=3600),
    Knob("MINDIO_AUTO_PATCH_MEGATRON", _bool, False,
         "1: route megatron-core checkpoint save/load through mindio.save/load."),
    # --- replica cross-check (mindio.adapter.crosscheck) ---
    Knob("MINDIO_CROSSCHECK_STEPS", int, 0,
         "N: every N optimizer steps the holders of each optimizer shard compare hashes (XXH3-64) of its N "
         "slices, so every byte is checked once every N steps; a mismatch raises ReplicaMismatch (incident "
         "replica_mismatch), or, with mindio.megatron.verified in the loop, rolls the job back to the last "
         "verified state. 0: off.", min=0, max=1 << 20),
    Knob("MINDIO_CROSSCHECK_WINDOW", int, 1000,
         "Steps within which a rank that is a holder in two replica mismatches is sub-healthy (mindio.megatron."
         "verified raises SubHealthyRank on it).", min=1, max=1 << 30),
    # --- drills (mindio.drill) ---
    Knob("MINDIO_DRILL_DIR", str, "",
         "Directory shared by a job's processes where --inject records fired faults (once per job, "
         "also across replaced processes); unset: once per process and first launch only."),
    # --- native core ---
    Knob("MINDIO_NATIVE", lambda t: t.strip().lower(), "",
         "python: use the pure-Python fallback of the native core even when the Cython one is built "
         "(read once, at the first import of mindio._native).", choices=("", "python", "cython")),
    # --- mindio-run: variables of torch/torchrun it honours as torchrun does (docs/launch.md) ---
    Knob("GLOO_SOCKET_IFNAME", str, "",
         "gloo's network interface(s). mindio-run checks that each named one exists with an IPv4 address, or "
         "sets it for a multi-node job to the interface of --local-addr, else the one routing to --master-addr."),
    Knob("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", float, 3.0,
         "mindio-run: default of --shutdown-timeout (seconds between the stop signal and SIGKILL of workers; "
         "torchrun's default is 30).", min=0, max=3600),
    Knob("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", str, "",
         "Prefix of the worker lines --tee copies to the console (${role_name}, ${rank}, ${local_rank}); "
         "default [<role><local rank>]:, as torchrun."),
    Knob("TORCH_NCCL_ASYNC_ERROR_HANDLING", str, "1", "Passed to the workers (default 1), as torchrun does."),
    Knob("CUDA_VISIBLE_DEVICES", str, "",
         "Passed to the workers; with --virtual-local-rank each worker gets only its own entry, as torchrun."),
    # --- replacement processes ---
    Knob("MINDIO_PG_TIMEOUT", int, 120,
         "Seconds a replacement process (recover-in-place / recover) waits in the rendezvous of its "
         "default process group when the training script gives no timeout.", min=1, max=86400),
    # --- set by mindio-run / torchrun for their workers (read, never set by hand) ---
    Knob("MINDIO_REBOOT_GEN", int, 0, "Generation a replacement process joins (0: not a replacement).",
         min=0, internal=True),
    Knob("MINDIO_REBOOT_TYPE", str, "arf", "What started a replacement process: arf or hot switch.",
         internal=True),
    Knob("MINDIO_SWITCH_BACKUP", str, "", "Store key a hot-switch backup process waits on.", internal=True),
    Knob("MINDIO_SWITCH_BACKUP_WAIT", float, 600.0,
         "Seconds a hot-switch backup waits to be released before giving up.", min=1, max=86400, internal=True),
    Knob("MINDIO_AGENT_STORE", str, "", "host:port of the node agent's TCPStore.", internal=True),
    Knob("MINDIO_AGENT_PID", int, 0, "Process id of the worker's node agent (kill-node drills).", internal=True),
    Knob("MINDIO_NODE_RANK", int, 0, "Node rank of the worker's agent.", internal=True),
    Knob("MINDIO_WORKER_WARMUP_S", float, 0.0, "Seconds a warm worker spent importing before its assignment.",
         internal=True),
    Knob("RANK", int, 0, "Global rank of the worker (torchrun's contract).", internal=True),
    Knob("LOCAL_RANK", int, 0, "Rank of the worker on its node (torchrun's contract).", internal=True),
    Knob("GROUP_RANK", int, 0, "Node rank of the worker (torchrun's contract).", internal=True),
    Knob("WORLD_SIZE", int, 1, "Number of workers of the job (torchrun's contract).", internal=True),
    Knob("LOCAL_WORLD_SIZE", int, 1, "Number of workers on this node (torchrun's contract): all of them on one "
         "node keeps the job secret out of the store (mindio/_secret.py); a launcher's siblings "
         "(processor/preempt.py).", internal=True),
    # set by Slurm in a job step; mindio-run reads them to fill --nnodes/--node-rank/--rdzv-endpoint
    # (mindio/launch/slurm.py, docs/slurm.md)
    Knob("SLURM_JOB_ID", str, "", "Slurm's job id (its port: 29400 + id mod 1000).", internal=True),
    Knob("SLURM_STEP_ID", str, "", "Slurm's step id: set inside an srun step.", internal=True),
    Knob("SLURM_JOB_NODELIST", str, "", "The job's nodes (Slurm's compressed host list).", internal=True),
    Knob("SLURM_STEP_NODELIST", str, "", "The step's nodes (Slurm's compressed host list).", internal=True),
    Knob("SLURM_NNODES", str, "", "Number of nodes of the job.", internal=True),
    Knob("SLURM_STEP_NUM_NODES", str, "", "Number of nodes of the step.", internal=True),
    Knob("SLURM_STEP_NUM_TASKS", str, "", "Number of tasks of the step (one mindio-run per node).", internal=True),
    Knob("SLURM_NODEID", str, "", "This node's index in the job.", internal=True),
    Knob("SLURMD_NODENAME", str, "", "This node's Slurm name.", internal=True),
    Knob("TORCHELASTIC_RESTART_COUNT", int, 0, "How many times the launcher restarted the job.", internal=True),
    Knob("TORCHELASTIC_RUN_ID", str, "", "The job's run id (torchrun's contract); with MINDIO_AGENT_STORE or "
         "MASTER_ADDR:MASTER_PORT it names a rank's record of the exception its job dumped after "
         "(mindio/ttp/processor/repeats.py).", internal=True),
    Knob("MASTER_ADDR", str, "", "Host of the job's store (torchrun's contract).", internal=True),
    Knob("MASTER_PORT", str, "", "Port of the job's store (torchrun's contract).", internal=True),
    Knob("TORCHELASTIC_ERROR_FILE", str, "",
         "Where a worker records the exception (or the fault) that ended it, in torchrun's error-file format; "
         "the launcher's failure summary reads it (torchrun's contract).", internal=True),
]

KNOBS: dict[str, Knob] = {k.name: k for k in _ALL}


def is_set(name: str, environ=None) -> bool:
    """Is the variable ``name`` (a declared knob) set to a non-empty value?"""
    _ = KNOBS[name]
    return bool((os.environ if environ is None else environ).get(name))


def get(name: str, environ=None) -> Any:
    """Value of the environment variable ``name``, parsed and validated (its default when unset)."""
    try:
        knob = KNOBS[name]
    except KeyError:
        raise ConfigError(f"{name} is not a mindio environment variable; known: {sorted(KNOBS)}") from None
    return knob.read(environ)


def table() -> str:
    rows = [f"{k.name:32} {k.allowed():60} {k.doc}" for k in _ALL if not k.internal]
    rows.append("\nset by mindio-run / torchrun for their workers (read by mindio, not to be set by hand):")
    rows += [f"{k.name:32} {k.doc}" for k in _ALL if k.internal]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
