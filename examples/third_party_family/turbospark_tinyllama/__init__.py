"""tinyllama: an example third-party turbospark family (a plain Llama-style decoder)."""
