"""turbospark: run LLM families on MLX and keep many conversations warm on one model."""
