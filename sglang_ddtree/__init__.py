"""DDTree tree speculative decoding for SGLang (plugin) with a transformers reference engine."""

__version__ = "0.1.0"
