"""GGUF files: their tensor index, conversion to a Hugging Face folder, and placing their blocks in a model."""
