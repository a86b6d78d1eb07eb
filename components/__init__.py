"""Plain-Python building blocks shared by every layer: config, artifacts, corpus IO, tokenizer."""
