"""Random-weight demo checkpoints and their locally trained tokenizer."""
