"""The engine loop and its front doors: LLMEngine, AsyncLLMEngine, the offline LLM, engine options, detokenization."""
