"""Trained drafters: the modules that drafter training and inference both import (an EAGLE-style head, a draft
model's adapter). Each drafter is built from the target's own pieces where it can (``model.lean.LlamaLayer``'s
``project_qkv`` / ``attention_output`` / ``mlp``) and proposes through the engine's ``Proposer`` protocol."""
