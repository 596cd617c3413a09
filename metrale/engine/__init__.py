"""Layer 6: what users run — sampling, generate, speculative decoding, perplexity,
embeddings, transcription and a reference continuous-batching scheduler."""
from .embeddings import embed
from .generate import GenerationResult, generate
from .perplexity import perplexity
from .sampling import SamplingParams
from .scheduler import Request, Scheduler
from .speculative import speculative_generate

__all__ = ["SamplingParams", "GenerationResult", "generate", "speculative_generate",
           "perplexity", "embed", "Scheduler", "Request"]
