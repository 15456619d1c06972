"""The stock transformers forward (`--runner hf`): any causal LM, its KV cache a DynamicCache per session."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.runners.vocab import output_token_ids

# A feed of at most this many tokens (a step, a verify) joins the padded batch; a longer one runs alone.
PADDED_FEED = 32


class CausalLMRunner:
    """Feeds token ids to a Hugging Face causal LM, growing and cropping its KV cache."""

    def __init__(self, model, vocab_size: int, device=None):
        """device: where the model runs (default: where it is); it moves there whole, once."""
        out_dim = model.get_output_embeddings().weight.shape[0]
        if out_dim < vocab_size:
            raise ValueError(f"model scores {out_dim} tokens but its tokenizer has {vocab_size}")
        self.model = model if device is None else model.to(device)
        self.vocab_size = vocab_size
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.scored_ids = output_token_ids(model)  # the tokens the model scores, ascending, on the CPU; None: all
        self._scored_ids_on_device = None if self.scored_ids is None else self.scored_ids.to(self.device)
        self._outside = None
        if self.scored_ids is not None:  # a draft that scores only these tokens: everything else gets probability 0
            self._outside = torch.ones(vocab_size, dtype=torch.bool, device=self.device)
            self._outside[self._scored_ids_on_device] = False

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def describe(self) -> str:
        return "transformers forward"

    @property
    def numerics(self) -> str:
        """What a pass's numbers are (ModelInfo.numerics): the weights' dtype."""
        return str(self.dtype).removeprefix("torch.")

    @staticmethod
    def crop(cache, length: int) -> None:
        drop = cache.get_seq_length() - length
        if drop > 0:
            cache.crop(-drop)

    @torch.inference_mode()
    def forward(self, cache, token_ids: list[int], num_logits: int, scored_only: bool = False) -> torch.Tensor:
        """Append token_ids to the cache; logits of the last num_logits positions: [num_logits, vocab] float32,
        or with scored_only [num_logits, len(scored_ids)], the columns of the tokens the model scores."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=num_logits)
        return self._columns(out.logits[0, :, : self.vocab_size].float(), scored_only)  # [num_logits, vocab]

    @torch.inference_mode()
    def forward_batch(
        self, caches: list, token_ids: list[list[int]], num_logits: list[int], scored_only: bool = False
    ) -> list[torch.Tensor]:
        """Several sessions' feeds, each with the logits ``forward`` gives it alone. The feeds of at most
        PADDED_FEED tokens (steps and verifies) run as one padded pass (see _padded); a longer one (a prompt's
        piece) runs alone, so that it pads no one else's rows to its length."""
        out: list = [None] * len(caches)
        short = [i for i, t in enumerate(token_ids) if len(t) <= PADDED_FEED]
        alone = [i for i in range(len(caches)) if len(token_ids[i]) > PADDED_FEED or len(short) == 1]
        for i in alone:
            out[i] = self.forward(caches[i], token_ids[i], num_logits[i], scored_only)
        if len(short) > 1:
            pick = lambda seq: [seq[i] for i in short]
            for i, logits in zip(short, self._padded(pick(caches), pick(token_ids), pick(num_logits), scored_only)):
                out[i] = logits
        return out

    def _padded(
        self, caches: list, token_ids: list[list[int]], num_logits: list[int], scored_only: bool
    ) -> list[torch.Tensor]:
        """One padded pass over several sessions, each as ``forward`` runs it alone: session i's cached keys and
        values left-padded to the longest cache, its new tokens right-padded to the longest feed, its own
        positions, and a mask that lets each row see only its session's cache and the new tokens before it.
        The new keys and values are then appended to each session's own cache. Logits are computed only at
        the positions some session asks for. The batch's shapes choose the GEMMs, so logits match the lone
        pass to float rounding, not bit for bit."""
        from transformers import DynamicCache

        lens, ns = [c.get_seq_length() for c in caches], [len(t) for t in token_ids]
        past, new, dev = max(lens), max(ns), self.device
        ids = torch.zeros(len(caches), new, dtype=torch.long)
        for i, t in enumerate(token_ids):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        positions = torch.tensor(lens)[:, None] + torch.arange(new)[None]  # [B, new]
        mask = torch.zeros(len(caches), 1, new, past + new, dtype=torch.bool)
        for i, n in enumerate(lens):
            mask[i, 0, :, past - n : past] = True  # the session's own cache, left-padded
        mask[:, 0, :, past:] = torch.ones(new, new, dtype=torch.bool).tril()  # causal over the new rows
        batch = DynamicCache(config=self.model.config)
        if past:
            shape = next(c.layers[0].keys.shape for c, n in zip(caches, lens) if n)

            def pad(c, n, layer, kind):  # a session's cached keys or values, left-padded to `past`
                if not n:
                    return torch.zeros(1, shape[1], past, shape[3], dtype=self.dtype, device=dev)
                return F.pad(getattr(c.layers[layer], kind), (0, 0, past - n, 0))

            for layer in range(len(next(c for c, n in zip(caches, lens) if n).layers)):
                batch.update(
                    torch.cat([pad(c, n, layer, "keys") for c, n in zip(caches, lens)]),
                    torch.cat([pad(c, n, layer, "values") for c, n in zip(caches, lens)]),
                    layer,
                )
        first = min(n - k for n, k in zip(ns, num_logits))  # the first position any session needs logits at
        out = self.model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions.to(dev),
            past_key_values=batch,
            use_cache=True,
            logits_to_keep=torch.arange(first, new, device=dev),
        )
        for layer, cached in enumerate(batch.layers):
            for i, (c, n) in enumerate(zip(caches, ns)):
                c.update(
                    cached.keys[i : i + 1, :, past : past + n], cached.values[i : i + 1, :, past : past + n], layer
                )
        logits = out.logits[..., : self.vocab_size].float()  # [B, new - first, vocab]
        return [
            self._columns(logits[i, n - k - first : n - first], scored_only)
            for i, (n, k) in enumerate(zip(ns, num_logits))
        ]

    def _columns(self, logits: torch.Tensor, scored_only: bool) -> torch.Tensor:
        if scored_only and self._scored_ids_on_device is not None:
            return logits[:, self._scored_ids_on_device]
        if self._outside is not None:
            logits.masked_fill_(self._outside, float("-inf"))
        return logits

    @property
    def batch_invariant(self) -> bool:
        """Padded batches take other GEMMs than a lone pass (see forward_batch): no."""
        return False
