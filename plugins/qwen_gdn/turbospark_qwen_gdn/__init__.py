"""The qwen_gdn family for turbospark."""
