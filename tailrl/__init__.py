"""tailrl: RL post-training whose rollout engine removes the long tail with lossless speculative decoding."""

__version__ = "0.1.0"
