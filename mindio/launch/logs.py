"""Where each worker's output and error file go: torchrun's ``--log-dir`` / ``--redirects`` / ``--tee`` /
``--local-ranks-filter`` / ``--duplicate-std*-filters``, with torchrun's own code for the layout.

torch.distributed.elastic's ``DefaultLogsSpecs`` (or the ``--logs-specs`` plugin) decides the paths, once
per round (= torchrun's attempt)::

    <log-dir>/<rdzv-id>_<random>/attempt_<round>/<local rank>/{stdout.log, stderr.log, error.json}

and sets ``TORCHELASTIC_ERROR_FILE`` in each worker's environment; torch's ``TailLog`` copies tee'd
files to the agent's console with the ``[<role><local rank>]:`` prefix (or
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``). A worker's bootstrap redirects its own stdout/stderr to the
paths of its assignment (a warm spare is started before it knows its rank), appending: a replacement of
a rank in the same round continues its file.

Without ``--log-dir`` only the error files are written, in a private temporary directory that is
removed when the agent ends (torchrun leaves its ``torchelastic_*`` directory behind).
"""
from __future__ import annotations

import os
import shutil
import sys
from string import Template

from . import tmpdirs

__all__ = ["WorkerLogs"]


class WorkerLogs:
    """One agent's log destinations, per round."""

    def __init__(self, cfg):
        from torch.distributed.elastic.multiprocessing.api import Std
        from torch.distributed.run import _get_logs_specs_class

        self.cfg = cfg
        self._tmp = None if cfg.log_dir else tmpdirs.make("mindio-run-")  # mode 0700, locked (tmpdirs.py)
        spec_cls = _get_logs_specs_class(cfg.logs_specs)
        self.spec = spec_cls(log_dir=cfg.log_dir or self._tmp, redirects=Std.from_str(cfg.redirects),
                             tee=Std.from_str(cfg.tee), local_ranks_filter=cfg.local_ranks_filter)
        self.dest = None
        self._round = None
        self._tails: list = []
        self._filtered: list = []

    def new_round(self, rnd: int, envs: dict) -> None:
        """Paths for round ``rnd``; ``envs`` ({local rank: worker env}) gain TORCHELASTIC_ERROR_FILE."""
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog

        self.stop()
        str_envs = {lr: {k: str(v) for k, v in env.items()} for lr, env in envs.items()}
        self.dest = self.spec.reify(str_envs)
        for lr, env in envs.items():
            env["TORCHELASTIC_ERROR_FILE"] = str_envs[lr]["TORCHELASTIC_ERROR_FILE"]
        self._round = rnd
        prefixes = self._prefixes(envs)
        d, role = self.dest, self.cfg.role
        self._tails = [TailLog(role, d.tee_stdouts, sys.stdout, prefixes).start(),
                       TailLog(role, d.tee_stderrs, sys.stderr, prefixes).start()]
        for needles, files, path in ((self.cfg.duplicate_stdout_filters, d.tee_stdouts, d.filtered_stdout),
                                     (self.cfg.duplicate_stderr_filters, d.tee_stderrs, d.filtered_stderr)):
            if needles and files:
                out = open(path, "w", errors="replace", buffering=1)  # noqa: SIM115 (closed in stop)
                self._filtered.append(out)
                self._tails.append(TailLog(role, files, out, prefixes,
                                           log_line_filter=lambda line, n=tuple(needles): any(x in line for x in n)
                                           ).start())

    def _prefixes(self, envs: dict) -> dict | None:
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
        if not template:
            return None
        return {lr: Template(template).safe_substitute(role_name=self.cfg.role, rank=env["RANK"], local_rank=lr)
                for lr, env in envs.items()}

    def has_round(self, rnd: int) -> bool:
        return self.dest is not None and self._round == rnd

    def streams(self, local_rank: int) -> tuple:
        """(stdout path, stderr path) of ``local_rank``'s worker; None: the agent's console."""
        d = self.dest
        return (d.stdouts.get(local_rank) or None, d.stderrs.get(local_rank) or None)

    def error_file(self, local_rank: int) -> str:
        return self.dest.error_files.get(local_rank, "") if self.dest is not None else ""

    def clear_error(self, local_rank: int) -> None:
        """Before a replacement of ``local_rank`` starts: its predecessor's error file is not its own."""
        path = self.error_file(local_rank)
        if path and path != os.devnull and os.path.isfile(path):
            os.remove(path)

    def stop(self) -> None:
        """(end of a round) The tee threads copy what is left, then stop."""
        for t in self._tails:
            t.stop()
        for f in self._filtered:
            f.close()
        self._tails, self._filtered = [], []
        sys.stdout.flush()
        sys.stderr.flush()

    def close(self) -> None:
        self.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
