"""The OpenAI-compatible HTTP server over the engine (app, metrics, serve), and the vLLM launcher."""
