"""specgraph's ops: one module per op (Triton kernel, registration, plain-torch reference).

Imports nothing else of specgraph. Built so far: ``bitmask`` (ancestor masks)
and ``verify`` (reference verification).
"""
