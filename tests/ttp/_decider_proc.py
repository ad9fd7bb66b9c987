"""An external decider (the reference's MindCluster) hosting the controller in its own process.

``python _decider_proc.py WORLD PORT OUT SCENARIO``: starts a controller (rank -1), registers every
report callback through ``tft_register_mindx_callback`` (each call is appended to ``OUT/decider.jsonl``)
and plays SCENARIO through the ``tft_notify_controller_*`` functions:

* ``choose:<strategy>``  answer report_strategies with change_strategy(<strategy>)
* ``silent``             never answer (the built-in policy takes over after MINDIO_WAIT_MINDX_TIME)
* ``pause:<hold_s>``     once every rank passed step 3: stop_train(stop_type="pause", timeout=60); after
                         report_stop_complete, wait <hold_s> s, then change_strategy("continue")
* ``pause-timeout:<t>``  pause with timeout=<t> and never answer (training must continue by itself)
* ``dump``               once every rank passed step 3: tft_notify_controller_dump()

Exits when the controller reaches FINAL or every rank left (BYE), at most after 150 s.
"""
import json
import os
import sys
import threading
import time

import mindio.ttp as ttp
from mindio.ttp._runtime import state as _rt


def main() -> int:
    world, port, out, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    log = open(os.path.join(out, "decider.jsonl"), "a")
    lock = threading.Lock()

    def record(kind, **kw):
        with lock:
            log.write(json.dumps({"t": time.time(), "kind": kind, **kw}) + "\n")
            log.flush()

    ttp.tft_init_controller(-1, world, enable_local_copy=False)
    ttp.tft_start_controller("127.0.0.1", port, enable_tls=False)
    ctl = _rt.controller
    stopped = threading.Event()

    def fault_ranks(ranks):
        record("report_fault_ranks", ranks={str(k): v for k, v in ranks.items()})

    def stop_complete(code, msg, ranks):
        record("report_stop_complete", code=code, msg=msg, ranks={str(k): v for k, v in ranks.items()})
        stopped.set()

    def strategies(ranks, options):
        record("report_strategies", ranks={str(k): v for k, v in ranks.items()}, options=list(options))
        if scenario.startswith("choose:"):
            record("change_strategy", strategy=scenario.split(":", 1)[1],
                   rc=ttp.tft_notify_controller_change_strategy(scenario.split(":", 1)[1]))

    def result(code, msg, ranks, strategy):
        record("report_result", code=code, msg=msg, ranks={str(k): v for k, v in ranks.items()}, strategy=strategy)

    for action, func in (("report_fault_ranks", fault_ranks), ("report_stop_complete", stop_complete),
                         ("report_strategies", strategies), ("report_result", result)):
        ttp.tft_register_mindx_callback(action, func)
    print("decider up", flush=True)

    def all_past(step):
        with ctl._lock:
            return len(ctl.ranks) == world and all(r.step >= step for r in ctl.ranks.values())

    end = time.monotonic() + 150
    acted = False
    seen_all = False
    while time.monotonic() < end and not ctl.final.is_set():
        seen_all = seen_all or ctl._registered == world
        if seen_all and ctl._registered == 0:
            break  # every rank finished and left
        if not acted and scenario.split(":")[0] in ("pause", "pause-timeout", "dump") and all_past(3):
            acted = True
            if scenario == "dump":
                record("notify_dump", rc=ttp.tft_notify_controller_dump())
            else:
                hold = float(scenario.split(":")[1])
                timeout = 60 if scenario.startswith("pause:") else hold
                record("notify_pause", rc=ttp.tft_notify_controller_stop_train({}, stop_type="pause",
                                                                                timeout=timeout))
                if scenario.startswith("pause:") and stopped.wait(30):
                    time.sleep(hold)
                    record("change_strategy", strategy="continue",
                           rc=ttp.tft_notify_controller_change_strategy("continue"))
        time.sleep(0.01)
    record("done", state=ctl.sm.state.value, exit_code=ctl.exit_code,
           history=[(a.value, r.value, b.value) for a, r, b in ctl.sm.history])
    ttp.tft_destroy_controller()
    return 0


if __name__ == "__main__":
    sys.exit(main())
