"""TensorRT-LLM adapter (in progress)."""
