"""SGLang adapter (in progress)."""
