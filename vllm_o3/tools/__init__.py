"""Tools that make O3 checkpoints (`vllm-o3 ...`)."""
