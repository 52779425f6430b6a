"""Text generation from a trained checkpoint: the model loaded for any tensor-parallel size
(``loader``), a KV cache (``kv_cache``), vocabulary-parallel sampling (``sampling``), the batch
generation loop that streams tokens (``engine``) and stop-string-aware text (``text``). The
command-line tool is ``tools/generate.py``; the OpenAI-compatible server ``tools/serve.py``."""

from megatron.inference.engine import Completion, Event, InferenceEngine, PromptError, PromptScores, Request
from megatron.inference.kv_cache import KVCache
from megatron.inference.loader import DTYPES, initialize, load_model, tokenizer_for, torch_device
from megatron.inference.sampling import MAX_LOGPROBS, RequestError, SamplingParams

__all__ = ["DTYPES", "MAX_LOGPROBS", "Completion", "Event", "InferenceEngine", "KVCache", "PromptError", "PromptScores",
           "Request", "RequestError", "SamplingParams", "initialize", "load_model", "tokenizer_for", "torch_device"]
