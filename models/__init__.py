"""Reference Flax models for shardplan: GPT-2-style and Llama-style decoders (NNX) and a Linen MLP stack."""
