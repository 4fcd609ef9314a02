"""Chunked model state as the solver plans it (model.py)."""
