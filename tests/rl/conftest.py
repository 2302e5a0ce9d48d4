"""Tests of the RL loop (tailrl/rl/): algorithms, the actor's update, LoRA, rewards, checkpoints, faults, partial
rollouts.

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""
