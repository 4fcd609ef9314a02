"""Strategies: what each node may do on the mesh (node.py) and the ILP's variables over them (groups.py)."""
