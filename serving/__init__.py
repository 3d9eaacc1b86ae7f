"""The user-facing side of kvrelay: the offline `LLM` API, the OpenAI-compatible HTTP server on Ray Serve
(serving/app.py) and the `kvrelay` command line (serving/cli.py)."""

from serving.llm import LLM
from workers.outputs import CompletionOutput, RequestOutput
from workers.sampling_params import SamplingParams
from workers.structured_params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StructuredOutputsParams"]
