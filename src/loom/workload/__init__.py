"""The vocabulary `loom bench` and `loom simulate` share: the trace format and synthetic
mixes, arrivals and the offered load, SLOs, and typed results (a request's, a run's, a
sweep's, a comparison's) read and written as the JSON files loom has always written.
Torch-free and HTTP-free: bench sends it to a server, sim to the simulated engine."""
