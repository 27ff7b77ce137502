"""PASTA's research pipeline (arXiv 2502.11517): everything that makes and scores a PASTA model, apart from the
decoder it trains for (:mod:`fastforward.pasta`: the language, its layout and the interpreter).

* :mod:`.annotate` -- PASTA-LANG annotation of ``make-data`` answers without an external LLM (``pasta annotate``)
* :mod:`.sft` -- the training batch read off the layout: PASTA attention mask, Pred-10X positions, promise targets
* :mod:`.methods` -- the two training methods over the shared trainer (``train pasta-sft``, ``train pasta-bon``)
* :mod:`.bon` -- one BoNBoN round: sampling, best/worst of n, the BoNBoN loss (``pasta sample``)
* :mod:`.judge` -- the quality judge (a proxy, or an OpenAI-compatible endpoint)
* :mod:`.evaluation` -- several models against one Baseline on held-apart prompts (``pasta evaluate``)
"""
