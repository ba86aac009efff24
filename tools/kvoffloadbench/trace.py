"""A synthetic multi-turn chat trace with shared system prompts (benchmarks only).

The generator, given a seed, is deterministic:

- ``system_prompts`` system prompts, each ``system_prompt_blocks`` long (uniform), are
  chosen by conversations with Zipf(``prompt_zipf_s``) popularity: a few prompts are
  shared by most conversations, as with a handful of popular applications.
- ``conversations`` conversations start as a Poisson process (mean gap
  ``mean_start_gap_s``). Each has a Zipf(``turns_zipf_s``)-distributed number of turns
  (1..``max_turns``); each turn appends ``turn_blocks`` (uniform) new blocks, the
  previous answer and the new question, after an exponential think time
  (``mean_think_s``).
- Requests arrive in time order; turn t of a conversation sends its whole history:
  the system prompt, then every block of turns 1..t.
- Block keys chain like vLLM's block hashes: a key hashes its parent key and its own
  content, so equal prefixes give equal keys and nothing else does.
- Each request goes to a random engine (``route``), as a load balancer without prefix
  affinity would send it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceConfig:
    seed: int = 1
    system_prompts: int = 32
    system_prompt_blocks: tuple[int, int] = (8, 48)
    prompt_zipf_s: float = 1.1
    conversations: int = 600
    turns_zipf_s: float = 1.2
    max_turns: int = 12
    turn_blocks: tuple[int, int] = (2, 12)
    mean_start_gap_s: float = 1.0
    mean_think_s: float = 20.0
    tokens_per_block: int = 16


@dataclass(frozen=True)
class Request:
    arrival_s: float
    conversation: int
    turn: int
    keys: list[bytes]


def zipf_choice(rng: np.random.Generator, n: int, s: float, size: int) -> np.ndarray:
    """Ranks 0..n-1 with P(rank k) proportional to 1 / (k + 1) ** s."""
    p = 1.0 / np.arange(1, n + 1) ** s
    return rng.choice(n, size=size, p=p / p.sum())


def chain(parent: bytes, content: bytes) -> bytes:
    return hashlib.blake2b(parent + content, digest_size=16).digest()


def generate(cfg: TraceConfig) -> list[Request]:
    rng = np.random.default_rng(cfg.seed)
    lo, hi = cfg.system_prompt_blocks
    prompts: list[list[bytes]] = []
    for p in range(cfg.system_prompts):
        keys, parent = [], b""
        for i in range(int(rng.integers(lo, hi + 1))):
            parent = chain(parent, b"sys%d.%d" % (p, i))
            keys.append(parent)
        prompts.append(keys)
    choice = zipf_choice(rng, cfg.system_prompts, cfg.prompt_zipf_s, cfg.conversations)
    turns = zipf_choice(rng, cfg.max_turns, cfg.turns_zipf_s, cfg.conversations) + 1
    starts = np.cumsum(rng.exponential(cfg.mean_start_gap_s, cfg.conversations))
    requests = []
    tlo, thi = cfg.turn_blocks
    for c in range(cfg.conversations):
        history = list(prompts[int(choice[c])])
        t_s = float(starts[c])
        for t in range(int(turns[c])):
            for i in range(int(rng.integers(tlo, thi + 1))):
                history.append(chain(history[-1], b"conv%d.%d.%d" % (c, t, i)))
            requests.append(Request(t_s, c, t, list(history)))
            t_s += float(rng.exponential(cfg.mean_think_s))
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def route(requests: list[Request], engines: int, seed: int) -> list[int]:
    """The engine of each request: uniformly random, no prefix affinity."""
    picks = np.random.default_rng(seed + 1).integers(0, engines, len(requests))
    return [int(e) for e in picks]


def unique_blocks(requests: list[Request]) -> int:
    return len({k for r in requests for k in r.keys})
