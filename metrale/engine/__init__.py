"""Layer 6: what users run — sampling, generate, speculative decoding, perplexity,
embeddings, transcription, chat prompts, streaming text and a reference
continuous-batching scheduler."""
from .chat import apply_chat_template, render_chat_template
from .detokenize import StreamDetokenizer
from .embeddings import embed
from .generate import GenerationResult, generate
from .generation_config import GenerationDefaults, generation_defaults
from .perplexity import PerplexityResult, perplexity, perplexity_details
from .sampling import SamplingParams
from .scheduler import Request, Scheduler
from .speculative import speculative_generate

__all__ = ["SamplingParams", "GenerationResult", "generate", "speculative_generate",
           "perplexity", "perplexity_details", "PerplexityResult", "embed", "Scheduler",
           "Request", "apply_chat_template", "render_chat_template", "StreamDetokenizer",
           "GenerationDefaults", "generation_defaults"]



def __getattr__(name):
    # `metrale.engine.transcribe` (the module; its function is
    # `metrale.engine.transcribe.transcribe`) pulls in the audio front end: on first use
    if name == "transcribe":
        import importlib
        return importlib.import_module(f"{__name__}.transcribe")
    raise AttributeError(f"module 'metrale.engine' has no attribute {name!r}")
