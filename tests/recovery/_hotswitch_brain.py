"""mindio-run (node 0's agent, in this process) plus a cluster brain driving its hosted controller.

``python _hotswitch_brain.py SCENARIO OUT -- <mindio-run arguments>`` (or ``-m _hotswitch_brain <mindio-run
arguments>`` with HS_SCENARIO and HS_OUT in the environment). Once every rank passed step
``HS_AT`` (default 5) it calls ``tft_notify_controller_prepare_action("hot switch", {HS_RANK: 1})`` on the
controller the agent hosts (rank -1) and plays SCENARIO through the reference API:

* ``switch``   answer report_stop_complete with change_strategy("migration")
* ``stop``     answer report_stop_complete with prepare_action("stop switch")
* ``silent``   never answer (the switch is cancelled after MINDIO_WAIT_MINDX_TIME)
* ``direct``   no cluster-brain callbacks: the switch goes on at once
* ``early``    prepare_action("stop switch") right after the request, while the backups start

Every call and callback is appended to ``OUT/brain.jsonl``. Once the switch is past its backups'
registration (the pause began, or the switch was cancelled) the brain creates ``OUT/release``: a job
held there (a ``hold`` fault of the toy's plan, tests/_faultplan.py; the example's ``--inject hold:...``
with MINDIO_DRILL_DIR=OUT) is still training when the backups register, however slowly they start.
"""
import json
import os
import sys
import threading
import time

import mindio.ttp as ttp
from mindio.launch import cli, ha
from mindio.ttp._runtime import state as _rt
from mindio.ttp.controller.states import State


def main() -> None:
    if "--" in sys.argv:
        scenario, out = sys.argv[1], sys.argv[2]
        argv = sys.argv[sys.argv.index("--") + 1:]
    else:  # ``python -m _hotswitch_brain <mindio-run arguments>`` with HS_SCENARIO and HS_OUT set
        scenario, out, argv = os.environ["HS_SCENARIO"], os.environ["HS_OUT"], sys.argv[1:]
    at, rank = int(os.environ.get("HS_AT", "5")), int(os.environ.get("HS_RANK", "1"))
    log, lock = open(os.path.join(out, "brain.jsonl"), "a"), threading.Lock()

    def record(kind, **kw):
        with lock:
            log.write(json.dumps({"t": time.time(), "kind": kind, **kw}) + "\n")
            log.flush()

    def stop_complete(code, msg, ranks):
        record("report_stop_complete", code=code, msg=msg)
        if scenario == "switch":
            record("change_strategy", rc=ttp.tft_notify_controller_change_strategy("migration"))
        elif scenario == "stop":
            record("stop_switch", rc=ttp.tft_notify_controller_prepare_action("stop switch"))

    def brain(ctl):
        _rt.controller = ctl  # the tft_notify_controller_* functions reach the hosted controller
        if scenario != "direct":
            ttp.tft_register_mindx_callback("report_stop_complete", stop_complete)
            ttp.tft_register_mindx_callback(
                "report_result", lambda code, msg, ranks, strategy: record("report_result", code=code, msg=msg,
                                                                           strategy=strategy))
        end = time.monotonic() + 120
        while time.monotonic() < end:
            with ctl._lock:
                ready = len(ctl.ranks) == ctl.world_size and all(r.step >= at for r in ctl.ranks.values())
                pids = {r.rank: r.pid for r in ctl.ranks.values()}
            if ready:
                rc = ttp.tft_notify_controller_prepare_action("hot switch", {rank: 1})
                if scenario == "early":
                    record("stop_switch", rc=ttp.tft_notify_controller_prepare_action("stop switch"))
                record("prepare_action", pids=pids, rc=rc)
                armed = time.monotonic() + 120
                while rc == 0 and time.monotonic() < armed:
                    with ctl._lock:  # backups registered (PAUSE), or the switch is over (no incident)
                        if ctl.sm.state is not State.NORMAL or ctl.incidents.current is None:
                            break
                    time.sleep(0.01)
                open(os.path.join(out, "release"), "w").close()
                return
            time.sleep(0.01)

    original = ha.HostedController.__init__

    def hosted(self, agent, rnd):
        original(self, agent, rnd)
        threading.Thread(target=brain, args=(self.ctl,), daemon=True).start()

    ha.HostedController.__init__ = hosted
    cli.main(argv)


if __name__ == "__main__":
    main()
