"""The offline engine: decode steps, the roofline, dtypes, speculative decoding."""
