"""``CheckpointHelper``: MindIO ACP's per-rank checkpoint helper for Megatron-style save/load code.

One instance per rank (``CheckpointHelper(rank) is CheckpointHelper(rank)``). Call order of a save::

    helper = CheckpointHelper(rank)
    helper.save_model_checkpoint(name, state_dict)                  # model, args, iteration, rng
    helper.save_optimizer_checkpoint(optim_name, get_parameter_state)  # ranks that hold a shard return it
    helper.async_write_tracker_file(iteration, iteration_dir, file_count, tracker_filename)
    ...                                                             # next iteration
    helper.wait_d2h_finished()                                      # before the optimizer step

What differs from the reference (docs/migration.md): a save returns once the bytes are in the node's
memory pool (``mindio.save``: the copy the reference runs on a background D2H stream), so
``wait_d2h_finished`` waits only for work handed to :meth:`async_save_checkpoint`; a failed save
raises :class:`mindio.errors.CheckpointError` instead of being logged; ``load_model_checkpoint``
reads the file on every rank (from the pool when it is there) instead of reading on ``load_rank``
and broadcasting a pickle, and unpickles with ``weights_only=True`` unless told otherwise.
"""
from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from typing import Callable, List, Union

from ..errors import CheckpointError, ConfigError
from . import _files, _storage, api

__all__ = ["CheckpointHelper"]

_log = logging.getLogger(__name__)
MAX_PATH = 1024          # the reference's limit on a checkpoint path
TRACKER_TIMEOUT_S = 300  # how long async_write_tracker_file waits for the iteration's files (as the reference)


def _names(checkpoint_name: Union[str, List[str]]) -> list:
    names = [checkpoint_name] if isinstance(checkpoint_name, (str, os.PathLike)) else list(checkpoint_name)
    if not names:
        raise ConfigError("checkpoint_name: give a file path or a non-empty list of paths")
    for name in names:
        if len(os.fspath(name)) > MAX_PATH:
            raise ConfigError(f"checkpoint path of {len(os.fspath(name))} characters: at most {MAX_PATH}")
    return names


class CheckpointHelper:
    """MindIO ACP's per-rank checkpoint helper: ``CheckpointHelper(rank)`` is one object per rank.
    Save, tracker and load methods for Megatron-style checkpoint code; what differs from the reference
    is in docs/migration.md."""

    _instances: dict = {}
    _instances_lock = threading.Lock()

    def __new__(cls, rank: int):
        with cls._instances_lock:
            if rank not in cls._instances:
                helper = super().__new__(cls)
                helper.rank = int(rank)
                helper._cond = threading.Condition()
                helper._in_flight = 0
                helper._local = threading.local()  # on a worker thread: has it counted itself yet?
                cls._instances[rank] = helper
            return cls._instances[rank]

    def __init__(self, rank: int):
        pass  # state is set once per rank in __new__ (one helper per rank, as the reference's singleton)

    # ------------------------------------------------------------------ save
    def save_model_checkpoint(self, checkpoint_name: Union[str, List[str]], model: dict) -> None:
        """Save ``model`` (a state dict) to one path or to each path of a list (one copy in the pool)."""
        names = _names(checkpoint_name)
        rc = api.save(model, names[0]) if len(names) == 1 else api.multi_save(model, names)
        if rc is None or rc < 0:
            raise CheckpointError(f"rank {self.rank}: saving {names} failed on every path (memory pool, direct "
                                  "write, torch.save); the log above says why")

    def save_optimizer_checkpoint(self, checkpoint_name: Union[str, List[str]],
                                  get_parameter_state_func: Callable) -> None:
        """Call ``get_parameter_state_func()`` (or ``(notify_callback=...)``); save what it returns. Ranks
        that hold no shard to save return None and save nothing."""
        names = _names(checkpoint_name)
        params = inspect.signature(get_parameter_state_func).parameters
        if len(params) > 1 or (len(params) == 1 and "notify_callback" not in params):
            raise ConfigError("get_parameter_state_func takes no argument or one named notify_callback")
        state = get_parameter_state_func(notify_callback=lambda *a: None) if params else get_parameter_state_func()
        if state is not None:
            self.save_model_checkpoint(names, state)

    def async_write_tracker_file(self, iteration: int, iteration_dir: str, total_file_count: int,
                                 tracker_filename: str, callback: Callable | None = None) -> None:
        """Write ``iteration`` to ``tracker_filename`` once ``iteration_dir`` holds ``total_file_count``
        files persisted to storage (checked in the background, up to 300 s); then ``callback(iteration,
        0)``. If they are not all there in time the tracker is left alone and ``callback(iteration, 1)``."""
        if len(iteration_dir) > MAX_PATH or len(tracker_filename) > MAX_PATH:
            raise ConfigError(f"iteration_dir / tracker_filename longer than {MAX_PATH} characters")
        if not os.path.isdir(iteration_dir):
            raise ConfigError(f"iteration_dir {iteration_dir!r} is not a directory")

        def done(result: int, step: int) -> None:
            if result == 0:     # temp file (O_EXCL|O_NOFOLLOW), fsync, rename, directory fsync
                _storage.atomic_write(os.path.realpath(tracker_filename), [str(step).encode()],
                                      mode=_storage.file_mode())
            else:
                _log.error("rank %d: iteration %d: %s did not hold %d persisted files within %d s; tracker "
                           "%s not updated", self.rank, step, iteration_dir, total_file_count, TRACKER_TIMEOUT_S,
                           tracker_filename)
            if callback is not None:
                callback(step, result)

        _files.register_checker(done, {os.path.realpath(iteration_dir): int(total_file_count)}, int(iteration),
                                TRACKER_TIMEOUT_S)

    # ------------------------------------------------------------------ background work
    def async_save_checkpoint(self, thread_func: Callable, kwargs: dict) -> None:
        """Run ``thread_func(**kwargs)`` on a thread; :meth:`wait_d2h_finished` waits until it calls
        :meth:`async_checkpoint_count` (its copy is done) or returns, whichever comes first."""
        with self._cond:
            self._in_flight += 1

        def run():
            self._local.pending = True
            try:
                thread_func(**kwargs)
            except Exception:
                _log.exception("rank %d: asynchronous checkpoint function failed", self.rank)
            finally:
                if self._local.pending:
                    self.async_checkpoint_count()

        threading.Thread(target=run, name=f"mindio-ckpt-helper-{self.rank}", daemon=True).start()

    def async_checkpoint_count(self) -> None:
        """Mark one piece of work of :meth:`async_save_checkpoint` as copied (the reference: D2H done)."""
        self._local.pending = False
        with self._cond:
            self._in_flight = max(0, self._in_flight - 1)
            self._cond.notify_all()

    def wait_d2h_finished(self, timeout: float = 3600.0) -> None:
        """Block until the work of :meth:`async_save_checkpoint` has been copied; at most ``timeout`` s."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._in_flight:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank}: {self._in_flight} asynchronous checkpoint save(s) "
                                       f"still copying after {timeout:.0f} s")
                self._cond.wait(left)

    def get_checkpoint_copy_stream(self):
        """A CUDA stream for device-to-host copies, or None without CUDA (the reference: an NPU stream)."""
        import torch

        return torch.cuda.Stream() if torch.cuda.is_available() else None

    # ------------------------------------------------------------------ load
    def async_preload(self, load_path: str) -> None:
        """Read ``load_path``'s latest_checkpointed_iteration.txt and copy that iteration's files into the
        node's memory pool in the background, so the loads that follow hit memory."""
        if len(load_path) > MAX_PATH:
            raise ConfigError(f"load_path longer than {MAX_PATH} characters")
        tracker = os.path.join(load_path, "latest_checkpointed_iteration.txt")
        try:
            text = open(tracker).read().strip()
        except FileNotFoundError:
            _log.info("rank %d: no %s, nothing to preload", self.rank, tracker)
            return
        folder = os.path.join(load_path, "release" if text == "release" else f"iter_{int(text):07d}")
        files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in sorted(fs)]
        if files:
            threading.Thread(target=api.preload, args=files, name="mindio-preload", daemon=True).start()

    def load_model_checkpoint(self, checkpoint_name: str, load_rank: int, process_group=None, *,
                              weights_only: bool = True):
        """Load ``checkpoint_name`` (from the node's pool when it is there, else from storage)."""
        if len(checkpoint_name) > MAX_PATH:
            raise ConfigError(f"checkpoint path longer than {MAX_PATH} characters")
        if load_rank < 0:
            raise ConfigError(f"load_rank {load_rank} must be >= 0")
        return api.load(checkpoint_name, map_location="cpu", weights_only=weights_only)
