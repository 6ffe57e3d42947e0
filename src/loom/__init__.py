"""loom: a continuous-batching LLM inference engine and OpenAI-compatible server."""

from loom.entrypoints.llm import LLM
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
