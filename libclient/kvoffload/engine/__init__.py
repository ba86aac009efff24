"""Engines' never-waiting machinery: what the vLLM and SGLang plug-ins build on.

Rules:
- A scheduler step never waits for the daemon: lookups answer from a local key
  mirror (``view``), stores take leased slots, changes go one-way once per step.
- A worker never reports a daemon fault to the engine (``streaming``): a store that
  cannot happen finishes uncommitted, a planned load completes or names its error.
"""
