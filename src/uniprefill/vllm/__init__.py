"""vLLM integration: the plugin entry point, model adapters and the runtime."""
