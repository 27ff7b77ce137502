"""PASTA: learned asynchronous decoding (arXiv 2502.11517): the annotation language, its interpreter, metrics and
annotation. See docs/pasta.md."""
