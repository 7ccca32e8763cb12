"""The math of speculative decoding: sampling warpers, acceptance (greedy, `tokens`,
`logits` rejection sampling), choosing tokens for a batch, the counter-based RNG and the
adaptive draft-length controller. Batched tensor code, no processes."""
