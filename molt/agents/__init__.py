"""Agents that ship with Molt; each module exports `AgentRunner` and `dataset(split, size, seed)`."""
