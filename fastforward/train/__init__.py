"""Training and research pipelines: the methods that make a model faster to decode in parallel (``fastforward train
METHOD``) and the data they learn from. Decoding code never imports this package (tests/test_layering.py).

* :mod:`fastforward.train.run` -- one training run, shared by every method: the process group, resume, atomic
  checkpoints, the per-step log, progress, the time budget, stopping on Ctrl-C or SIGTERM with a checkpoint
* :mod:`fastforward.train.trainer` -- fine-tuning the target itself (LoRA or full): ``msn``, ``cllm``, ``pasta-*``
* :mod:`fastforward.train.drafter_train` -- drafters over the target's features: ``eagle``, ``fasteagle``, ``falcon``
* :mod:`fastforward.train.draft_model` -- the small draft model of ``--method sps`` (``train draft-model``)
* :mod:`fastforward.train.data`, :mod:`fastforward.train.make_data`, :mod:`fastforward.train.trajectories` -- the
  training data: instruction/response records, the target's own responses, Jacobi trajectories
* :mod:`fastforward.train.pasta` -- PASTA's research pipeline (annotation, SFT, BoN, the judge, evaluation)

Heavy imports (torch, transformers, peft, accelerate) happen inside functions, so importing this package is cheap.
"""
