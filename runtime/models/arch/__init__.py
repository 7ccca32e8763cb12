"""The model itself: the Llama-family decoder, its attention over the KV cache, RoPE, the fused
elementwise pieces and Triton kernels, FP8 linears, and the tensor-parallel plan beside it."""
