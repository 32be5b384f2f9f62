"""Model execution: the decoder, its tensor-parallel layers, the safetensors loader, the model runner and the sampler."""
