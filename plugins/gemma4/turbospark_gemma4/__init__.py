"""The gemma4 family for turbospark."""
