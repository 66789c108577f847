"""``eagle``: drafts from an EAGLE-style head over the target's hidden states.

The head (``eagle_head.EagleHead``, loaded from ``speculative_model=PATH``) shares the
target's embedding and LM head. After each step the engine gives the target's final hidden
state ``h`` at the position that produced each request's newest token ``x``; draft 1 comes from
``head(x, h)``, draft ``j + 1`` from ``head(draft j, g_j)`` where ``g_j`` is the head's own
output hidden state, all requests of the batch together, one head forward per draft.

The head's decoder layer keeps its own KV cache per request: a contiguous list of entries
``(position, input token, key, value)``. Each step appends one entry per draft; at the next
step the entries whose input token is no longer the request's (rejected drafts) or whose
position now has a target hidden state are dropped (rolled back) and that position is
recomputed from the target's ``h``. Accepted drafts keep the entry computed from the head's own
``g`` (the engine hands over the target's hidden state of the newest token only), and the
prompt positions before the first draft have no entries (prefill hidden states are not kept),
so the head attends to what it saw since the request started decoding (the training script
trains for that). Cost per ``propose``: the batch's entries are copied into one padded
[B, L] tensor (L the longest cache, at most ``max_model_len``), then one head forward and one
LM-head matmul per draft step with a [B, L + step] masked attention; a Python loop over the
requests gathers and stores their entries (not per token). Memory:
``2 * kv_heads * head_dim * L`` values per request, freed when the request finishes; caches
of requests not seen for a while are evicted (least recently drafted first) beyond
``2 * max_num_seqs`` requests, and an evicted request starts over with an empty cache. None
of this affects exactness (drafts are verified by the core), only acceptance.

Greedy requests get the head's argmax and no ``probs``; a request with temperature ``T > 0``
gets drafts sampled from ``softmax(logits / T)`` with those probabilities. The drafts are drawn
from one generator seeded from the engine's ``seed`` (not with it: see ``draft_seed``), so a
seeded request's output depends on the drafts, hence on what else ran in the engine before it
(the output distribution does not).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hitchllm.config import EngineConfig, ModelConfig
from hitchllm.speculative import Draft, DraftRequest, Proposal, ProposalBatch, Proposer
from hitchllm_specdec.draft_sampling import draft_seed
from hitchllm_specdec.eagle_head import CachedRows, EagleHead, build_head, read_head_config


@dataclass
class HeadCache:
    """One request's entries of the head's KV cache (positions increasing); the first
    ``num_checked`` survived a roll-back, so their tokens are the sequence's for good."""

    positions: list[int]
    tokens: list[int]
    keys: torch.Tensor
    values: torch.Tensor
    num_checked: int = 0

    def roll_back(self, token_ids: Sequence[int], first_recomputed: int) -> None:
        """Keep the entries before ``first_recomputed`` whose input token is still the
        sequence's token after their position (only the last step's entries can fail, unless
        the request id was reused: the first and last checked entries are compared too)."""
        keep = self.num_checked
        if keep and any(self.positions[i] + 1 >= len(token_ids)
                        or token_ids[self.positions[i] + 1] != self.tokens[i]
                        for i in (0, keep - 1)):
            keep = 0
        for pos, tok in zip(self.positions[keep:], self.tokens[keep:], strict=True):
            if pos >= first_recomputed or token_ids[pos + 1] != tok:
                break
            keep += 1
        del self.positions[keep:], self.tokens[keep:]
        self.keys, self.values = self.keys[:keep], self.values[:keep]
        self.num_checked = keep


class EagleProposer(Proposer):
    """Drafts ``num_speculative_tokens`` tokens per request with an EAGLE head."""

    needs_hidden_states = True

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        if not engine_config.speculative_model:
            raise ValueError(
                "speculative_method='eagle' needs speculative_model=PATH, a directory with an "
                "EAGLE head's config.json and model.safetensors (scripts/train_eagle_head.py "
                "trains one for the bundled model)")
        self.path = engine_config.speculative_model
        self.head_config = read_head_config(self.path)
        self.head: EagleHead | None = None
        # The target's LM head (its compute_logits), shared with the head.
        self.compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.caches: OrderedDict[str, HeadCache] = OrderedDict()
        self.max_cached_requests = 2 * engine_config.max_num_seqs
        self.generator: torch.Generator | None = None

    def bind_target_model(self, model: torch.nn.Module) -> None:
        target = getattr(model, "config", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        head = self.head_config
        if not isinstance(target, ModelConfig) or embed is None:
            raise ValueError(
                f"speculative_method='eagle' needs a target of the Llama family "
                f"({head.architecture} for this head); {type(model).__name__} has no "
                "model.embed_tokens to share")
        for what, ours, theirs in (("architecture", head.architecture, target.architecture),
                                   ("hidden_size", head.hidden_size, target.hidden_size),
                                   ("vocab_size", head.vocab_size, target.vocab_size)):
            if ours != theirs:
                raise ValueError(
                    f"the EAGLE head at speculative_model={self.path!r} has {what} {ours}, "
                    f"the target model {theirs}: a head only drafts for the model it was "
                    "trained on; train one for this model (scripts/train_eagle_head.py)")
        weight = next(model.parameters())
        self.head = build_head(head, embed.forward, self.path, weight.device, weight.dtype)
        self.compute_logits = model.compute_logits
        self.generator = torch.Generator(weight.device)
        # Not the target sampler's stream (see draft_sampling.draft_seed).
        self.generator.manual_seed(draft_seed(self.engine_config.seed or 0))

    def remove_requests(self, request_ids: list[str]) -> None:
        """Free the head caches of finished requests."""
        for rid in request_ids:
            self.caches.pop(rid, None)

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> Proposal:
        assert self.head is not None and self.compute_logits is not None
        assert batch.hidden_states is not None
        requests = batch.requests
        device = batch.hidden_states.device
        caches = [self._cache_of(r) for r in requests]
        context = self._context(caches, device)
        # The newest token sits at len - 1; its hidden state came from position len - 2.
        positions = torch.tensor([len(r.token_ids) - 2 for r in requests], device=device)
        tokens = torch.tensor([r.token_ids[-1] for r in requests], device=device)
        temperatures = [_temperature(r) for r in requests]
        temperature = torch.tensor(temperatures, device=device)
        sampled_rows = temperature > 0
        any_sampled = any(t > 0 for t in temperatures)  # (no device read)
        hidden = batch.hidden_states.to(next(self.head.parameters()).dtype)
        max_position = self.head_config.max_position_embeddings - 1
        num_steps = max(r.max_num_drafts for r in requests)
        drafts, probs = [], []
        for step in range(num_steps):
            # Rows past their own limit run along; their positions are clamped, their
            # drafts dropped.
            step_positions = (positions + step).clamp(max=max_position)
            hidden = self.head(tokens, hidden, step_positions, context)
            logits = self.compute_logits(hidden).float()
            tokens = logits.argmax(dim=-1)
            if any_sampled:
                q = torch.softmax(logits / temperature.clamp(min=1e-5)[:, None], dim=-1)
                drawn = torch.multinomial(q, 1, generator=self.generator)[:, 0]
                tokens = torch.where(sampled_rows, drawn, tokens)
                probs.append(q)
            drafts.append(tokens)
        draft_ids = torch.stack(drafts, dim=1).tolist()
        self._store(requests, caches, context, draft_ids)
        stacked = torch.stack(probs, dim=1) if probs else None
        return Proposal({
            r.request_id: Draft(
                draft_ids[i][: r.max_num_drafts],
                stacked[i, : r.max_num_drafts] if stacked is not None and temperatures[i] > 0
                else None)
            for i, r in enumerate(requests)
        })

    def _cache_of(self, r: DraftRequest) -> HeadCache:
        cache = self.caches.pop(r.request_id, None)
        if cache is None:
            assert self.head is not None
            attn, weight = self.head.attention, self.head.fc.weight
            empty = torch.empty(0, attn.num_kv_heads, attn.head_size, dtype=weight.dtype,
                                device=weight.device)
            cache = HeadCache([], [], empty, empty)
        else:
            cache.roll_back(r.token_ids, len(r.token_ids) - 2)
        self.caches[r.request_id] = cache
        while len(self.caches) > self.max_cached_requests:
            self.caches.popitem(last=False)
        return cache

    def _context(self, caches: list[HeadCache], device: torch.device) -> CachedRows:
        """The batch's cached keys/values, padded to the longest (padding masked out)."""
        assert self.head is not None
        attn, dtype = self.head.attention, self.head.fc.weight.dtype
        length = max(len(c.positions) for c in caches)
        shape = (len(caches), length, attn.num_kv_heads, attn.head_size)
        keys = torch.zeros(shape, dtype=dtype, device=device)
        values = torch.zeros(shape, dtype=dtype, device=device)
        valid = torch.zeros(len(caches), length, dtype=torch.bool, device=device)
        for i, c in enumerate(caches):
            n = len(c.positions)
            keys[i, :n], values[i, :n], valid[i, :n] = c.keys, c.values, True
        return CachedRows(keys, values, valid)

    def _store(self, requests: list[DraftRequest], caches: list[HeadCache],
               context: CachedRows, drafts: list[list[int]]) -> None:
        """Append each request's new entries: one per draft it may use, the first from the
        target's hidden state, the others from the head's."""
        start = context.keys.shape[1] - len(drafts[0])
        for i, (r, c) in enumerate(zip(requests, caches, strict=True)):
            n = r.max_num_drafts
            first = len(r.token_ids) - 2
            c.positions.extend(range(first, first + n))
            c.tokens.extend([r.token_ids[-1], *drafts[i][: n - 1]])
            c.keys = torch.cat([c.keys, context.keys[i, start : start + n]])
            c.values = torch.cat([c.values, context.values[i, start : start + n]])


def _temperature(request: DraftRequest) -> float:
    """The request's sampling temperature; 0 for a greedy request, which accepts only the
    target's argmax, so the head drafts its own argmax there (no probs)."""
    params = request.sampling_params
    return 0.0 if params is None or params.greedy else params.temperature
