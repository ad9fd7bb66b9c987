"""``mindio-run``, the per-node launch agent (torchrun-compatible). See :mod:`mindio.launch.agent`.

The names below load on first use: a worker's bootstrap (mindio.launch._bootstrap) lives in this
package and must not pay for the agent's imports."""

__all__ = ["Agent", "LaunchConfig"]


def __getattr__(name):
    if name == "Agent":
        from .agent import Agent

        return Agent
    if name == "LaunchConfig":
        from .config import LaunchConfig

        return LaunchConfig
    raise AttributeError(f"module 'mindio.launch' has no attribute {name!r}")
