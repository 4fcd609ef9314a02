"""Chunked model state as the solver plans it: the model of chunks, working set and traffic
(model.py), the ILP's costs (cost.py) and memory (memory.py) with chunked parameters, and the plan's
``offload`` section with what chunks change in the rest of the plan (section.py)."""
