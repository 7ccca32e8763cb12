"""The fast path around a loaded model: decode/verify steps and prompt chunks at static shapes
replayed from CUDA graphs, host-to-device copies that never wait, and the KV memory budget."""
