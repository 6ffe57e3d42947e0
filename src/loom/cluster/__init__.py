"""Data-parallel loom: many engine replicas behind one OpenAI API, on Ray Serve.

`routing` is pure (no ray, no torch) so the fleet simulator can share it; the Ray modules are
imported only when `loom serve --data-parallel-size N` asks for N > 1.
"""
