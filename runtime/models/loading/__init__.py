"""Loading a model: checkpoint metadata, weight sources (safetensors, GGUF, synthetic), FP8
checkpoint formats, Hugging Face ids, the on-disk conversion cache, the transformers fallback."""
