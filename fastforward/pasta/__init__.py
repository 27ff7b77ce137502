"""PASTA: learned asynchronous decoding (arXiv 2502.11517): the annotation language, its layout, the interpreter
that decodes it and its metrics. The research pipeline that makes PASTA models (annotation, SFT, BoN, the judge,
evaluation) is :mod:`fastforward.train.pasta`. See docs/pasta.md."""
