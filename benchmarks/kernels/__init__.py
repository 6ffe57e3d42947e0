"""Single kernels and ops: decode and prefill attention, the native matmul, accuracy."""
