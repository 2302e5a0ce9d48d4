"""Rollout across workers: length-aware placement (HistoPipe), tail migration (RLHFSpec), Ray workers.

Importing this package does not import Ray: only `workers.py` and `rollout.py` (the N > 1 path) do."""
