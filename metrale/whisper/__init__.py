"""Whisper (encoder-decoder speech-to-text) behind the `SpeechToTextModel` contract."""
from .model import WhisperModel

__all__ = ["WhisperModel"]
