"""MSN ("Make Some Noise", EMNLP'24 §3.2): supervised fine-tuning with *ahead noise* in the response inputs.

For every training sequence and every step, one segment of ``L`` (``--noise-length``, default 4) consecutive
response tokens is replaced *in the input* by tokens drawn uniformly from the tokens before each position
(``x_j ~ U(x_<j)``, prompt included). The labels stay the clean tokens, so the loss is the ordinary causal-LM loss
on the response -- the model learns to predict the right next token from a prefix whose last few tokens are noise,
which is what a Jacobi iteration feeds it.

* Where the segment goes: ``random`` (the paper's choice) draws its start uniformly among the positions where it
  lies inside the response and before the last token (whose input predicts nothing); ``ppl`` (Appendix A) takes the
  window whose tokens have the lowest summed cross-entropy under the current model (one extra no-grad forward per
  micro-batch).
* A response shorter than ``L + 1`` tokens gets no noise (there is no room for a whole segment).
* ``--no-noise`` trains through the same code path without noise: the plain SFT baseline.

The noise functions below are pure (tensors and a ``torch.Generator`` in, tensors out); :class:`NoiseCollator` is
the seeded collator the trainer uses (``fastforward train msn``, in ``fastforward/cli/train.py``, runs it).
"""

from __future__ import annotations

from ..errors import UsageError
from .trainer import pad_batch, seed_key, token_losses

LOCATIONS = ("random", "ppl", "none")


# ------------------------------------------------------------------------------------------------------------------
# Pure noise functions
# ------------------------------------------------------------------------------------------------------------------


def candidate_range(prompt_len: int, length: int, noise_length: int) -> tuple[int, int]:
    """``[lo, hi)``: the segment starts that keep ``[start, start + L)`` inside the response and off the last token
    (empty when the response has fewer than ``L + 1`` tokens)."""
    lo = int(prompt_len)
    hi = int(length) - int(noise_length)  # start + L <= length - 1
    return lo, max(lo, hi)


def random_starts(prompt_lens, lengths, noise_length: int, generator):
    """A uniformly random segment start per sequence (``-1`` where the response is too short)."""
    import torch

    starts = torch.full((len(prompt_lens),), -1, dtype=torch.long)
    for b, (p, n) in enumerate(zip(prompt_lens.tolist(), lengths.tolist(), strict=True)):
        lo, hi = candidate_range(p, n, noise_length)
        if hi > lo:
            starts[b] = lo + int(torch.randint(hi - lo, (1,), generator=generator))
    return starts


def lowest_loss_starts(token_losses, prompt_lens, lengths, noise_length: int):
    """The start of the ``L``-token window with the lowest summed loss per sequence (Appendix A), among the same
    candidates as :func:`random_starts`; ties go to the earliest. ``token_losses[b, j]`` is the cross-entropy of
    token ``j`` given the tokens before it."""
    import torch

    losses = token_losses.detach().float().cpu()
    starts = torch.full((losses.shape[0],), -1, dtype=torch.long)
    for b, (p, n) in enumerate(zip(prompt_lens.tolist(), lengths.tolist(), strict=True)):
        lo, hi = candidate_range(p, n, noise_length)
        if hi <= lo:
            continue
        windows = losses[b, lo : hi + noise_length - 1].unfold(0, noise_length, 1).sum(-1)  # [hi - lo]
        starts[b] = lo + int(torch.argmin(windows))
    return starts


def apply_ahead_noise(input_ids, starts, noise_length: int, generator):
    """A copy of ``input_ids`` where, for each sequence with ``starts[b] >= 0``, positions ``starts[b] ..
    starts[b] + L - 1`` hold tokens drawn uniformly from the *clean* tokens before each position."""
    import torch

    clean = input_ids.cpu()
    noisy = clean.clone()
    for b, s in enumerate(starts.tolist()):
        if s < 0:
            continue
        for j in range(s, s + noise_length):
            src = int(torch.randint(j, (1,), generator=generator))
            noisy[b, j] = clean[b, src]
    return noisy.to(input_ids.device)


# ------------------------------------------------------------------------------------------------------------------
# The collator and the training method
# ------------------------------------------------------------------------------------------------------------------


class NoiseCollator:
    """Pads tokenized examples into a batch and (for ``location="random"``) adds the noise.

    ``collator(examples, key)`` returns ``input_ids`` (noisy), ``clean_input_ids``, ``labels`` (clean response
    tokens, -100 on prompt and padding), ``attention_mask``, ``prompt_lens``, ``lengths``, ``noise_start`` (-1 =
    no noise), ``num_tokens`` and ``noise_key``. The noise is a pure function of (``seed``, ``key``), so the same
    micro-batch gets the same noise in a resumed run. For ``location="ppl"`` the start is chosen later, from the
    model's losses (:meth:`MSN.loss`); ``noise_start`` is then -1 here.
    """

    def __init__(self, noise_length: int = 4, location: str = "random", seed: int = 0, pad_id: int = 0):
        if not isinstance(noise_length, int) or noise_length <= 0:
            raise UsageError(f"--noise-length must be a positive integer, got {noise_length}")
        if location not in LOCATIONS:
            raise UsageError(f"--noise-location must be one of {', '.join(LOCATIONS[:2])}, got '{location}'")
        self.noise_length = noise_length
        self.location = location
        self.seed = seed
        self.pad_id = pad_id

    def generator(self, key: int):
        import torch

        return torch.Generator().manual_seed(seed_key(self.seed, key))

    def __call__(self, examples, key: int = 0) -> dict:
        import torch

        batch = pad_batch(examples, self.pad_id)
        batch["clean_input_ids"] = batch["input_ids"]
        batch["noise_key"] = key
        starts = torch.full((len(examples),), -1, dtype=torch.long)
        if self.location == "random":
            gen = self.generator(key)
            starts = random_starts(batch["prompt_lens"], batch["lengths"], self.noise_length, gen)
            batch["input_ids"] = apply_ahead_noise(batch["clean_input_ids"], starts, self.noise_length, gen)
        batch["noise_start"] = starts
        return batch


class MSN:
    """The ``msn`` training method for :func:`fastforward.train.trainer.train`."""

    name = "msn"

    def __init__(self, noise_length: int = 4, location: str = "random", seed: int = 0, pad_id: int = 0):
        self.collator = NoiseCollator(noise_length, location, seed, pad_id)
        self.noised = 0
        self.sequences = 0

    @property
    def location(self) -> str:
        return self.collator.location

    def collate(self, examples, key: int) -> dict:
        return self.collator(examples, key)

    def loss(self, model, batch):
        import torch

        ids = batch["input_ids"]
        starts = batch["noise_start"]
        if self.location == "ppl":
            with torch.no_grad():
                clean_losses = token_losses(model, batch["clean_input_ids"], batch["attention_mask"], batch["labels"])
            L = self.collator.noise_length
            starts = lowest_loss_starts(clean_losses, batch["prompt_lens"], batch["lengths"], L)
            ids = apply_ahead_noise(batch["clean_input_ids"], starts, L, self.collator.generator(batch["noise_key"]))
            batch["noise_start"] = starts
        self.sequences += len(starts)
        self.noised += int((starts >= 0).sum())
        return token_losses(model, ids, batch["attention_mask"], batch["labels"]).sum()

    def stats(self) -> dict:
        return {
            "noise_length": self.collator.noise_length, "noise_location": self.location,
            "sequences_seen": self.sequences, "sequences_noised": self.noised,
        }
