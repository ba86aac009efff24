"""The benchmark trace generator (kvoffloadbench.trace): deterministic for a seed, with
shared system-prompt prefixes, growing conversations and Zipf popularity."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np

from kvoffloadbench.trace import TraceConfig, generate, route, unique_blocks, zipf_choice

CFG = TraceConfig(conversations=120, system_prompts=8)


def test_the_same_seed_gives_the_same_trace_and_routing() -> None:
    a, b = generate(CFG), generate(CFG)
    assert [r.keys for r in a] == [r.keys for r in b]
    assert route(a, 4, 1) == route(b, 4, 1) and set(route(a, 4, 1)) == {0, 1, 2, 3}
    other = generate(TraceConfig(seed=2, conversations=120, system_prompts=8))
    assert [r.keys for r in other] != [r.keys for r in a]


def test_requests_arrive_in_order_and_turns_extend_their_history() -> None:
    reqs = generate(CFG)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_conv: dict[int, list[list[bytes]]] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation, []).append(r.keys)
    for turns in by_conv.values():
        for before, after in itertools.pairwise(turns):
            assert after[: len(before)] == before and len(after) > len(before)
    assert unique_blocks(reqs) < sum(len(r.keys) for r in reqs)


def test_conversations_with_one_system_prompt_share_exactly_its_blocks() -> None:
    firsts = [r for r in generate(CFG) if r.turn == 0]
    by_prefix = Counter(r.keys[0] for r in firsts)
    assert 1 < len(by_prefix) <= CFG.system_prompts
    a, b = [r for r in firsts if r.keys[0] == by_prefix.most_common(1)[0][0]][:2]
    shared = next(i for i, (x, y) in enumerate(zip(a.keys, b.keys)) if x != y)
    lo, hi = CFG.system_prompt_blocks
    assert lo <= shared <= hi  # the system prompt, then each conversation's own blocks


def test_zipf_ranks_are_skewed_towards_the_first() -> None:
    picks = zipf_choice(np.random.default_rng(0), 10, 1.1, 20_000)
    counts = np.bincount(picks, minlength=10)
    assert counts[0] > 2 * counts[3] > 0 and counts[0] > 6 * counts[9]
