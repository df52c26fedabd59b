"""The qwen4_exp family for turbospark."""
