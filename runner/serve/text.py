"""Text encoding off the denoiser's path: a shard's prompts in one text-encoder call, each distinct
negative prompt once per worker.

Contract:
- `TextCache.of(pipe, family, mask_feature)` (`family`: the model's `Family` record, whose
  `encode` is the one encoder call): the pipeline's encoder state (one per pipeline, kept
  on it: the negative prompts it has encoded, at most `NEGATIVES` of them); `batch` (default 1) is
  the encoder's batch, the worker sets it to the shard size.
- `key(item) -> tuple`: what an item's batch-mates must share (any thread; tokenizes under a lock).
- `encode(items) -> dict[id, Embeds]`: runs on the thread that owns the model (the worker's gpu
  thread): the items' prompts in chunks of exactly `batch` (the last chunk padded with empty
  prompts, so a compiled text encoder sees one shape), padded to the model's `max_tokens` with the
  tokenizer's attention mask, so a prompt's embedding does not depend on the prompts encoded with
  it. Returns, per item id, its embedding and what its batch-mates must share (`Embeds.key`).
- `call_kwargs(items, embeds) -> dict`: the pipeline arguments (`prompt_embeds=`, masks, negative
  embeddings, and `pooled_prompt_embeds=` where the family's encoder gives a pooled embedding:
  FLUX's CLIP) for a batch of items whose `Embeds.key` agree; the pipeline then encodes nothing.
  A family without a negative branch (`Family.negative_prompt=False`, guidance-distilled FLUX)
  gets no negative embeddings, and its rows' negative prompts are never encoded.

Families with `trim_text` (Latte, `mask_feature=True`, diffusers' default): LattePipeline trims a single prompt's embedding to
its token count and the negative prompt's to the same count, but for a batch of several it keeps
all 120 positions and zeroes the padding instead, which the unmasked cross-attention still
attends to: a video changed with its batch-mates. Here every batch has the single-prompt
semantics: items are batched only with items of the same token count (`Embeds.key`), each trimmed
to it, the negative embedding trimmed likewise.

Why: the text encoder (T5-XXL, 4.8 B parameters) ran twice per pipeline call, once for the same
empty negative prompt every time; one call over a shard reads the weights once for all its prompts.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger("runner")
NEGATIVES = 16     # distinct negative prompts kept per worker (embeddings, a few MB each)


@dataclass
class Embeds:
    prompt: torch.Tensor                 # (T, D) on the device
    mask: torch.Tensor | None            # (T,) PixArt's attention mask, else None
    negative: str
    key: tuple = ()                      # what batch-mates must share (trim_text: the token count)
    pooled: torch.Tensor | None = None   # (P,) FLUX's CLIP pooled embedding, else None


class _NoTruncationEcho(logging.Filter):
    """diffusers' pipelines log the whole cut-off part of an over-long prompt on every call; the
    runner says it once per prompt, in one short line (`TextCache.encode`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("The following part of your input was truncated")


def _quiet_truncation() -> None:
    for h in logging.getLogger("diffusers").handlers:
        if not any(isinstance(f, _NoTruncationEcho) for f in h.filters):
            h.addFilter(_NoTruncationEcho())


class TextCache:
    def __init__(self, pipe, family, mask_feature: bool):
        # the family's text length: one per family in its presets (PixArt-Σ reads 300 tokens)
        self.max_tokens = next(iter(family.presets.values()))["max_tokens"]
        self.pipe, self.family = pipe, family
        self.trim = family.trim_text
        self.batch, self.mask_feature = 1, mask_feature
        self.negatives: OrderedDict[str, tuple] = OrderedDict()
        self.lock = threading.Lock()   # a fast tokenizer refuses concurrent calls ("Already borrowed")
        # the tokenizer padding to max_tokens (FLUX: the T5's, `tokenizer_2`)
        self.tokenizer = getattr(pipe, family.tokenizer)

    @classmethod
    def of(cls, pipe, family, mask_feature: bool = True) -> "TextCache":
        tc = pipe.__dict__.get("_text_cache")
        if tc is None or tc.mask_feature != mask_feature:
            tc = pipe.__dict__["_text_cache"] = cls(pipe, family, mask_feature)
        return tc

    def _tokens(self, prompts: list[str]):
        return self.tokenizer(prompts, padding="max_length", max_length=self.max_tokens,
                                   truncation=True, return_attention_mask=True,
                                   add_special_tokens=True, return_tensors="pt")

    def key(self, item) -> tuple:
        if not self.trim:
            return ()
        if not self.mask_feature:
            return (item.negative_prompt, self.max_tokens)
        with self.lock:
            n = int(self._tokens([item.prompt]).attention_mask.sum())
        return (item.negative_prompt, n)

    # -- the family's encoder call: prompts (padded to `max_tokens`) -> (N, T, D), mask (N, T) ----

    def _run(self, prompts: list[str]) -> tuple:
        """(N, T, D), mask (N, T) | None, lengths, pooled (N, P) | None."""
        with self.lock:
            emb, mask, *more = self.family.encode(self.pipe, prompts, self.max_tokens)
            pooled = more[0] if more else None
            if self.trim and self.mask_feature:   # token counts from the host's tokenizer mask
                return emb, mask, self._tokens(prompts).attention_mask.sum(1).tolist(), pooled
            return emb, mask, [emb.shape[1]] * len(prompts), pooled

    def _chunks(self, prompts: list[str]):
        """(N, T, D), masks, lengths, pooled for `prompts`, in chunks of exactly `batch` rows."""
        embs, masks, lengths, pools = [], [], [], []
        for i in range(0, len(prompts), self.batch):
            chunk = prompts[i:i + self.batch]
            emb, mask, n, pooled = self._run(chunk + [""] * (self.batch - len(chunk)))
            embs.append(emb[:len(chunk)])
            masks.append(mask[:len(chunk)] if mask is not None else None)
            pools.append(pooled[:len(chunk)] if pooled is not None else None)
            lengths += n[:len(chunk)]
        mask = torch.cat(masks) if masks[0] is not None else None
        pooled = torch.cat(pools) if pools[0] is not None else None
        return torch.cat(embs), mask, lengths, pooled

    def negative(self, text: str) -> tuple:
        """(1, T, D), (1, T) | None, (1, P) | None: a negative prompt's embeddings."""
        if text not in self.negatives:
            emb, mask, _, pooled = self._run([text])
            self.negatives[text] = (emb, mask, pooled)
            if len(self.negatives) > NEGATIVES:
                self.negatives.popitem(last=False)
        self.negatives.move_to_end(text)
        return self.negatives[text]

    def _warn_long(self, items) -> None:
        with self.lock:
            counts = [len(ids) for ids in self.tokenizer([it.prompt for it in items]).input_ids]
        for it, n in zip(items, counts):
            if n > self.max_tokens:
                log.warning("prompt %r: %d tokens; the model reads the first %d, the rest is ignored",
                            it.id, n, self.max_tokens)

    def encode(self, items) -> dict[str, Embeds]:
        _quiet_truncation()
        self._warn_long(items)
        emb, mask, lengths, pooled = self._chunks([it.prompt for it in items])
        for it in items:   # guidance <= 1 runs no unconditional branch: its prompt is not encoded
            if self.family.negative_prompt and it.guidance_scale > 1:
                self.negative(it.negative_prompt)
        out = {}
        for k, it in enumerate(items):
            n = lengths[k]
            out[it.id] = Embeds(emb[k, :n], mask[k] if mask is not None else None, it.negative_prompt,
                                key=(it.negative_prompt, n) if self.trim else (),
                                pooled=pooled[k] if pooled is not None else None)
        return out

    def call_kwargs(self, items, embeds: dict[str, Embeds]) -> dict:
        es = [embeds[it.id] for it in items]
        if self.trim:
            assert len({e.key for e in es}) == 1 and len({e.negative for e in es}) == 1, \
                "trim_text batches share the token count and the negative prompt"
            n, neg = es[0].key[1], self.negative(es[0].negative)[0]
            return dict(prompt=None, negative_prompt=None, prompt_embeds=torch.stack([e.prompt for e in es]),
                        negative_prompt_embeds=neg[:, :n].expand(len(es), -1, -1))
        kw = dict(prompt=None, prompt_embeds=torch.stack([e.prompt for e in es]))
        if es[0].pooled is not None:   # FLUX: CLIP's pooled embedding beside T5's
            kw["pooled_prompt_embeds"] = torch.stack([e.pooled for e in es])
        if not self.family.negative_prompt or items[0].guidance_scale <= 1:
            return kw
        negs = [self.negative(e.negative) for e in es]
        kw.update(negative_prompt=None, negative_prompt_embeds=torch.cat([n[0] for n in negs]))
        if es[0].mask is not None:   # PixArt: the encoder's attention masks go with the embeddings
            kw.update(prompt_attention_mask=torch.stack([e.mask for e in es]),
                      negative_prompt_attention_mask=torch.cat([n[1] for n in negs]))
        if es[0].pooled is not None:
            kw["negative_pooled_prompt_embeds"] = torch.cat([n[2] for n in negs])
        return kw
