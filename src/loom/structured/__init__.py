"""Structured outputs: output constrained to a JSON schema, a regex, a choice of strings or a
grammar, with llguidance as the grammar engine.

`grammar` turns a request's StructuredOutputsParams into a checked llguidance grammar (cached
by kind and spec); `manager` compiles it against the model's tokenizer off the step loop and
fills the token bitmask of each step; `state` is one request's matcher. Torch-free: the
scheduler and the engine loop use it; the batched sampler applies the bitmask.
"""

# How a request's error starts when its constraint failed: its grammar could not be compiled,
# or it needs text the model's vocabulary cannot write. The client's spec, so the server
# answers 400, not 500.
GRAMMAR_ERROR_PREFIX = "structured_outputs: "
