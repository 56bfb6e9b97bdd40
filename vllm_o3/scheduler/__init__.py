"""Which request runs when: O3's priority-tier scheduler policy for vLLM."""
