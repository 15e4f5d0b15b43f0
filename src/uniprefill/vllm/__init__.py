"""vLLM integration: plugin entry point, engine checks, model classes, model state, runtime."""
