"""`loom simulate`: loom's real scheduler and KV cache on a virtual clock, step times from a
profile (calibrated on this machine, or a roofline model of a catalogued GPU), writing the
results `loom bench` writes. torch-free, except calibration."""
