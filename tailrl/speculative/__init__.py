"""Speculative decoding: drafters, draft trees, lossless verification, the selector and the speculator."""
