"""The target service: the large model whose distribution the output follows."""
