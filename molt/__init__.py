"""Molt: a PyTorch-native framework for agentic reinforcement learning of language models."""
