"""The `transformers` engine: a real random-weight hybrid model, its cache as vLLM pages, the logits oracle."""
