"""Model loading: the embedded default target, local Hugging Face directories, and drafters."""
