"""Which environment rolls out and scores each row.

`rollout.env_path` is a path (one environment for every row) or a mapping source -> path: each row
goes to the environment of its `source` (train/datasets/mixture.py tags rows with it). Sources that
name the same file share one loaded module and one thread pool.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from train.utils.typed_config import plain
from train.workers.config import RolloutConfig
from train.workers.environment import Environment


def env_paths(rollout: RolloutConfig) -> str | dict[str, str]:
    """`rollout.env_path`: one path, or source -> path."""
    return plain(rollout.env_path)


class EnvRouter:
    def __init__(self, env_path: str | Mapping[str, str], *, timeout_s: float, max_workers: int, max_turns: int):
        kwargs = dict(timeout_s=timeout_s, max_workers=max_workers, max_turns=max_turns)
        self.single: Environment | None = None
        self.by_source: dict[str, Environment] = {}
        if isinstance(env_path, str):
            self.single = Environment(env_path, **kwargs)
            self.envs = [self.single]
            return
        loaded: dict[str, Environment] = {}
        for source, path in env_path.items():
            real = os.path.realpath(path)
            if real not in loaded:
                loaded[real] = Environment(path, key=f"rollout.env_path.{source}", **kwargs)
            self.by_source[str(source)] = loaded[real]
        self.envs = list(loaded.values())

    @classmethod
    def of(cls, env: "Environment | EnvRouter") -> "EnvRouter":
        """A router for one ready-made environment (or the router itself)."""
        if isinstance(env, EnvRouter):
            return env
        router = cls.__new__(cls)
        router.single, router.by_source, router.envs = env, {}, [env]
        return router

    @property
    def routes(self) -> dict[str, Environment]:
        """source -> environment; empty when one environment takes every row."""
        return dict(self.by_source)

    def for_row(self, row: dict) -> Environment:
        if self.single is not None:
            return self.single
        return self.by_source[str(row["source"])]  # every row's source was checked at load (check_routes)

    @property
    def name(self) -> str:
        return ", ".join(env.name for env in self.envs)

    @property
    def stuck_calls(self) -> int:
        return sum(env.stuck_calls for env in self.envs)

    def longest_call(self) -> str:
        """The in-flight call of each environment that has one (for the watchdog's report)."""
        return "; ".join(filter(None, (env.longest_call() for env in self.envs)))

    def pop_api_calls(self) -> list[dict]:
        return [call for env in self.envs for call in env.pop_api_calls()]

    def close(self) -> None:
        for env in self.envs:
            env.close()
