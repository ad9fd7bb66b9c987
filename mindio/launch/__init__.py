"""``mindio-run``, the per-node launch agent (torchrun-compatible). See :mod:`mindio.launch.agent`."""
from .agent import Agent, LaunchConfig

__all__ = ["Agent", "LaunchConfig"]
