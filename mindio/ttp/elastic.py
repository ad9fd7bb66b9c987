"""Elastic training (MindIO ZIT): the public module. A downgrade scales the job in by whole DP slices
when ranks fail; an upgrade scales it back out when standby processes offer the removed ranks.

What a training script calls is here: :func:`start_standby` (in the process that offers a removed
rank back) and :func:`wait_for_scale_out` (it parks there until taken in, or ends with the job's code),
:func:`is_standby`, :func:`job_rank` (the controller's rank id of a torch rank in the
shrunken world). The code lives by the side of the wire it runs on -- elastic_flow.py (controller:
the downgrade and upgrade flows, :func:`plan_downgrade`), elastic_rank.py (processor: the zit
actions), standby.py (the standby process) -- and this module re-exports it; no module of
mindio.ttp imports this one. docs/elastic.md tells the whole story.
"""
from __future__ import annotations

from .controller.elastic_flow import (EXIT_CODE_REMOVED, UPGRADE_STOP_TRIES, Elastic, _repair_pairs,
                                      plan_downgrade)
from .processor.elastic_rank import is_standby, job_rank
from .standby import start_standby, wait_for_scale_out

__all__ = ["Elastic", "plan_downgrade", "start_standby", "wait_for_scale_out", "is_standby", "job_rank",
           "EXIT_CODE_REMOVED"]
