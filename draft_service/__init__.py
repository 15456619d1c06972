"""The draft service: a small model that proposes K tokens per round."""
