"""Costs in seconds: compute per strategy and resharding per edge (model.py), from the collectives a
placement pair needs (reshard.py)."""
