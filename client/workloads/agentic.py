"""The agentic workload: agent loops re-sending a context that grows by tool outputs."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kvmesh.client.workloads.config_checks import check_positive
from kvmesh.client.workloads.draws import tokens
from kvmesh.client.workloads.request import WorkloadRequest
from kvmesh.client.workloads.sessions import open_loop_sessions


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """Agent loops: every step re-sends the whole, growing context with short actions."""

    num_agents: int = 256
    """Agent runs."""
    steps_per_agent: int = 12
    """Model calls per run."""
    system_prompt_len: int = 3072
    """Tool specifications and instructions shared by every run."""
    task_len: int = 512
    """Tokens of each run's task description."""
    tool_output_len: int = 384
    """Tokens each tool call returns, appended before the next step."""
    action_len: int = 64
    """Tokens the model generates per step (a tool call); the next step quotes it."""
    tool_time_s: float = 2.0
    """Mean time between a step's arrival and the next one's (exponential)."""
    agent_rate_rps: float = 4.0
    """Poisson rate at which agent runs start, per second."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        check_positive(self, *(f.name for f in fields(self)))


def agentic(config: AgenticConfig, seed: int) -> list[WorkloadRequest]:
    rng = np.random.default_rng([seed, 4])
    v = config.vocab_size
    system = tokens(rng, config.system_prompt_len, v)

    def step(s: int, k: int, history: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int]:
        if history is None:
            prompt = np.concatenate([system, tokens(rng, config.task_len, v)])
        else:
            prompt = np.concatenate([history, tokens(rng, config.tool_output_len, v)])
        return prompt, tokens(rng, config.action_len, v), config.action_len

    return open_loop_sessions(
        rng,
        config.num_agents,
        config.agent_rate_rps,
        config.steps_per_agent,
        config.tool_time_s,
        step,
        "agent",
    )
