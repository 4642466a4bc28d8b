"""nanokv: a small LLM inference engine built around paged KV-cache memory management."""

from nanokv.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nanokv.config import EngineConfig
from nanokv.engine.llm import LLM
from nanokv.engine.llm_engine import LLMEngine
from nanokv.outputs import CompletionOutput, RequestOutput
from nanokv.sampling_params import SamplingParams
from nanokv.structured import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence"]
