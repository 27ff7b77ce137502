"""Training methods that make a model faster to decode in parallel (``fastforward train METHOD``).

* :mod:`fastforward.train.data` -- instruction/response records, the held-out split, chat-template tokenization
* :mod:`fastforward.train.trainer` -- the shared accelerate loop (LoRA or full, checkpoints, resume)
* :mod:`fastforward.train.msn` -- MSN noisy SFT (``fastforward train msn``)

Heavy imports (torch, transformers, peft, accelerate) happen inside functions, so importing this package is cheap.
"""
