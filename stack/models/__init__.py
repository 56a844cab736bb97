"""Local model directories built in-process (no hub): ``tiny`` (tokenizer + chat template)."""
