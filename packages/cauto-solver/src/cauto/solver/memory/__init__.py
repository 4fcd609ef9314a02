"""Per-device memory: the ILP's linear terms (model.py), the node-level walk of a step (walk.py) and a
plan's timeline rebuilt from the plan (timeline.py)."""
