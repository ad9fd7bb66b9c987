"""Recovery on the parallel layouts real Megatron jobs use, and checkpoints megatron-core reads.

4 ranks on CPU/gloo, examples/megatron/pretrain_gpt.py, 20 steps; every run is compared bit for bit
(state digest: model params and optimizer state of every rank) with the fault-free run of the same
layout (one per layout and session, _mgt_launch.layout_reference).

- TP1 x PP2 x DP2 (replicas R=2: each stage's optimizer shard on both DP ranks of the stage) and MoE
  EP2 x DP2 (4 experts; dense optimizer over DP4 and expert optimizer over each expert-DP group, R=2):
  one job under mindio-run (``HIGH_AVAILABILITY=recover-in-place,retry,dump``) takes three faults:
  a UCE on rank 1 at step 3 (retry: repaired in place from its replica), ``kill -9`` of rank 2 at
  step 5 (recover-in-place: a new process, repaired from its replica), an unknown error on rank 3 at
  step 8 (dump at step 7 by one replica of every shard, exit 75: the fault table the job is given
  sends unknown errors to dump -- by default they would be recovered in place too). The dump,
  relaunched, ends with the fault-free digest and every later loss equal.
- TP1 x PP2 x DP2: that dump read by megatron-core's own ``dist_checkpointing.load`` (no mindio on the
  load path) into freshly built models: the same digest at the same layout; the model weights at
  TP1 x PP1 x DP4 equal tensor for tensor (_mcore_load_worker.py).
- TP2 x PP2 x DP1 with 2 virtual stages per pipeline rank: no DP replica exists, so neither retry nor
  recover-in-place is possible, and neither is a dump (the faulty rank holds the only copy of its
  shard): an unknown error on rank 1 at step 7 ends the job (exit 76, the missing shard named); the
  periodic checkpoint of step 4 (Megatron's format) relaunched ends with the fault-free digest.

Elastic scale-in/out on TP1 x PP2 x DP2 is in test_elastic_megatron.py.
"""
from __future__ import annotations

import json
import re

import pytest

from _mgt_launch import (PRETRAIN, REPO, LAYOUT_ITERS, digests, layout_args, layout_reference, losses, torchrun,
                         SLOW_MEGATRON)

from tests._samples import assert_data_order

pytestmark = SLOW_MEGATRON

# mindio-run: the three-fault job (its controller in node 0's agent), and the runs whose launcher is not what
# they test (the --load relaunches, megatron-core's load worker): its fork server imports torch and
# megatron-core once for the 4 ranks (~8 CPU-s less than torchrun's 4 imports on this 2-core CI machine).
# The launcher changes no number (test_pretrain_gpt.py::test_runs_under_mindio_run). The TP2 x PP2 job whose
# "exitcode  : 76" is torchrun's summary stays under torchrun.
LAUNCH = "mindio.launch.cli"
WORKER = REPO / "tests" / "megatron" / "_mcore_load_worker.py"
FAULTS = "uce:rank=1,step=3; kill:rank=2,step=5; raise:rank=3,step=8"
# unknown errors -> dump (the default table recovers them in place, as it does a dead rank); a generic
# exception outside the update window too (the default retries it: RS_RETRY), the table opts it out
DUMP_UNKNOWN = {"levels": {"DumpOnly": {"severity": 2, "strategies": ["dump", "exit"]}},
                "faults": {"RS_UCE": "RestartRequest", "RS_HCCL_FAILED": "RestartRequest",
                           "RS_UCE_CORRUPTED": "RestartBusiness", "RS_RETRY": "DumpOnly",
                           "RS_UNKNOWN": "DumpOnly", "DEAD": "RestartBusiness"}}


def _events(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _relaunch(ckpt, args, ref_out, it, samples=None):
    """``--load ckpt`` (under mindio-run, LAUNCH): loads ``it`` and then reproduces ``ref_out`` (losses after
    ``it``, digest); ``samples``: the relaunch appends its sample-id log there, checked against ``ref_out``'s."""
    log = ["--log-samples", samples] if samples is not None else []
    out = torchrun(PRETRAIN, args + log + ["--load", ckpt], timeout=400, launcher=LAUNCH)
    assert f"loaded checkpoint iteration {it}" in out, out[-3000:]
    got, ref = losses(out), losses(ref_out)
    assert sorted(got) == list(range(it + 1, LAYOUT_ITERS + 1))
    assert all(repr(got[i]) == repr(ref[i]) for i in got), [(i, got[i], ref[i]) for i in got if got[i] != ref[i]]
    assert digests(out)[-1] == digests(ref_out)[-1]
    if samples is not None:  # every step trained, before and after the relaunch, on the fault-free batches
        assert_data_order(samples, ref_out.samples, LAYOUT_ITERS)
    return out


_RUNS: dict = {}


def _three_faults(layout, tmp_path_factory):
    """The mindio-run job with the three faults, once per layout and module: (output, events, ckpt)."""
    if layout not in _RUNS:
        d = tmp_path_factory.mktemp(f"faults-{layout}")
        table = d / "fault_table.json"
        table.write_text(json.dumps(DUMP_UNKNOWN))
        ckpt = d / "ckpt"
        rc, out = torchrun(PRETRAIN, layout_args(layout, dump=True) + ["--enable-hbmfault-repair", "--save", ckpt,
                                                            "--inject", FAULTS, "--log-samples", d / "samples"],
                           timeout=500, launcher=LAUNCH, check=False,
                           env={"HIGH_AVAILABILITY": "recover-in-place,retry,dump", "MINDIO_FAULT_TABLE": str(table),
                                "MINDIO_EVENT_LOG": str(d / "events.jsonl"), "MINDIO_DRILL_DIR": str(d),
                                "TTP_LOG_PATH": str(d / "logs")})
        assert rc != 0 and "the controller ended the job (exit code 75)" in out, out[-6000:]
        _RUNS[layout] = (out, _events(d / "events.jsonl"), ckpt)
    return _RUNS[layout]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", ["tp1pp2dp2", "moe_ep2dp2"])
def test_retry_recover_in_place_dump_relaunch_bitwise(layout, fault_free_run, tmp_path_factory):
    ref = layout_reference(fault_free_run, layout)
    out, evs, ckpt = _three_faults(layout, tmp_path_factory)
    for kind in ("uce", "kill", "raise"):
        assert f"injecting {kind} at step" in out
    retry = [e for e in evs if e["kind"] == "retry_done"]
    recover = [e for e in evs if e["kind"] == "recover_done"]
    dump = [e for e in evs if e["kind"] == "decision" and e["strategy"] == "dump"]
    assert [(e["lock_step"], e["repaired"]) for e in retry] == [(2, [1])], out[-4000:]
    assert [(e["strategy"], e["lock_step"], e["replaced"]) for e in recover] == [("recover-in-place", 4, [2])]
    assert [e["lock_step"] for e in dump] == [7]
    # the job ends after the dump (exit 75); before it no round of workers failed (no whole-job restart)
    assert all(e["t"] > dump[0]["t"] for e in evs if e["kind"] == "round_failed")
    assert sorted(losses(out)) == list(range(1, 8))  # every step up to the dump trained (once printed)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "7"
    files = {p.name for p in (ckpt / "iter_0000007").iterdir()}
    assert {".metadata", "common.pt", "metadata.json"} <= files, files
    print(f"\n{layout}: retry {retry[0]['total_s']:.3f} s, recover-in-place {recover[0]['total_s']:.3f} s, dump "
          f"written by ranks {sorted(r for i in dump[0]['save_info'] for r in i['ranks'])}: {sorted(files)}")
    # retry at 2, recover-in-place at 4, dump at 7, relaunch: the log goes on in the same directory
    again = _relaunch(ckpt, layout_args(layout), ref, 7, samples=ckpt.parent / "samples")
    if layout == "tp1pp2dp2":
        _RUNS["tp1pp2dp2-loaded"] = re.search(r"loaded checkpoint iteration 7: state-digest: ([0-9a-f]{64})",
                                             again).group(1)


@pytest.mark.timeout(1500)
def test_megatron_core_loads_the_dump(fault_free_run, tmp_path_factory, tmp_path):
    """megatron-core's dist_checkpointing.load reads the TP1 x PP2 x DP2 dump: the digest mindio's own
    loader printed at the same layout, and the same model tensors at TP1 x PP1 x DP4."""
    layout = "tp1pp2dp2"
    _, _, ckpt = _three_faults(layout, tmp_path_factory)
    if "tp1pp2dp2-loaded" not in _RUNS:
        _RUNS["tp1pp2dp2-loaded"] = re.search(
            r"loaded checkpoint iteration 7: state-digest: ([0-9a-f]{64})",
            torchrun(PRETRAIN, layout_args(layout) + ["--load", ckpt, "--train-iters", 7], timeout=400,
                     launcher=LAUNCH)).group(1)
    out = torchrun(WORKER, [ckpt / "iter_0000007", tmp_path, "--", *layout_args(layout)], timeout=400,
                   launcher=LAUNCH)
    assert re.search(r"mcore-load state-digest: ([0-9a-f]{64})", out).group(1) == _RUNS["tp1pp2dp2-loaded"]
    n = int(re.search(r"resharded-equal: (\d+) tensors", out).group(1))
    assert n > 0
    print(f"\nmegatron-core loaded the dump at TP1xPP2xDP2 (digest equal) and its {n} model tensors at TP1xPP1xDP4")


@pytest.mark.timeout(1200)
def test_no_replica_layout_falls_back_to_periodic_checkpoint(fault_free_run, tmp_path):
    layout = "tp2pp2dp1_vpp2"
    ref = layout_reference(fault_free_run, layout)
    ckpt = tmp_path / "ckpt"
    events = tmp_path / "events.jsonl"
    rc, out = torchrun(PRETRAIN, layout_args(layout, dump=True) + ["--save", ckpt, "--save-interval", 4,
                                                        "--inject", "raise:rank=1,step=7",
                                                        "--log-samples", tmp_path / "s"],
                       timeout=400, check=False,
                       env={"HIGH_AVAILABILITY": "dump", "MINDIO_EVENT_LOG": str(events),
                            "TTP_LOG_PATH": str(tmp_path / "logs")})
    assert rc != 0 and "exitcode  : 76" in out, out[-4000:]
    decision = [e for e in _events(events) if e["kind"] == "decision"]
    assert [(e["strategy"], e["lock_step"]) for e in decision] == [("exit", 6)]
    assert decision[0]["missing_shards"], decision  # rank 1's shard exists nowhere else
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    _relaunch(ckpt, layout_args(layout), ref, 4, samples=tmp_path / "s")  # steps 5, 6 trained again
