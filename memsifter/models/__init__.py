"""Models and how they run: the offline registry, the LLM client, vLLM's environment, encoders, Ray actor pools."""
