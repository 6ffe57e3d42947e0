"""Capacity planning without the hardware: the GPU catalogue, memory arithmetic and the
roofline step model that `loom plan` prints and `loom simulate` runs on. torch-free."""
