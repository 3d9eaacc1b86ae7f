"""The user-facing side of kvrelay: the offline `LLM` API (and, later, the HTTP server)."""

from serving.llm import LLM
from workers.outputs import CompletionOutput, RequestOutput
from workers.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
