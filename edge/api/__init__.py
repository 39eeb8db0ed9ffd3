"""The OpenAI wire format: pure, no I/O."""
