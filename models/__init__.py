"""Reference Flax models for shardplan: GPT-2-style and Llama-style decoders and a ResNet (NNX), a Linen MLP stack
and a Linen ViT."""
