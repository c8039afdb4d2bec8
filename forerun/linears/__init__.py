"""The linears a precision swaps into a model: int8, int4, the GGUF file's own blocks, float32 on the kernels (swap.py walks a model)."""
