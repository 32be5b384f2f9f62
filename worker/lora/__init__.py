"""Multi-LoRA: PEFT adapters, their GPU slots, and the per-adapter shrink and expand products."""
