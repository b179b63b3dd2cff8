"""The equivalence check of continuous batching's graphs: every key replayed on valid batches, against eager.

GraphRunner's generic padding check draws every integer input on its own,
which breaks the request structure the step's mask is built from (a token and
a key of one request); :class:`EquivalenceCheck` replaces it. For every key it
builds a synthetic batch whose metadata is valid (random requests, positions,
real cache slots; :meth:`~EquivalenceCheck._synthetic`), replays it padded to
the key, runs the step after it (one new token per request, reading every key
the batch wrote or read: :meth:`~EquivalenceCheck._follow_up`) and compares
both with the eager steps on the same batches unpadded, the paged cache put
back after each comparison. A difference is a :class:`~graphrunner.errors.CaptureError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.hf.batch_step import CacheGroup
from graphrunner.hf.refusals import refused

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from graphrunner.runner import GraphRunner

__all__ = ["EquivalenceCheck"]

#: A synthetic batch's plan: per request its queries (``lens_q``) and past (``past``), per allocator index
#: the past each request reads (``read_past``) and the cache slots drawn (``slots``).
Plan = dict[str, Any]


@dataclass
class EquivalenceCheck:
    """The check of ``runner``'s keys (captured over the paged cache whose tensor is ``cache``) against
    ``step``, the same forward run eagerly. ``dims``, ``groups``: the step's dims and the cache's
    allocators; ``vocab``: token ids are drawn below it; ``device``: where the step's inputs live;
    ``model``: named in the refusal. :meth:`run` checks every key."""

    runner: GraphRunner
    step: Callable[..., torch.Tensor]
    dims: tuple[str, ...]
    groups: Sequence[CacheGroup]
    cache: torch.Tensor
    vocab: int
    device: torch.device
    model: PreTrainedModel

    def run(self) -> int:
        """Every key: a synthetic valid batch replayed padded, then a follow-up step that reads what it wrote,
        against both run eagerly without padding."""
        runner = self.runner
        gen = torch.Generator().manual_seed(0x6B76)
        by_dim = {d: sorted({k[i] for k in runner.keys}) for i, d in enumerate(self.dims)}
        checked = 0
        # every comparison starts from the cache as it is now and puts it back: one copy serves them all
        saved = self.cache.clone()
        for key in sorted(runner.keys, key=lambda k: tuple(k)):
            small = []
            for i, d in enumerate(self.dims):
                below = [b for b in by_dim[d] if b < key[i]]
                small.append(max(1, (below[-1] + 1) if below else 1))
            # the smallest sizes that replay the key (padded); when those land on another key, the key's own sizes
            for sizes in (small, list(key)):
                made = self._synthetic(key, sizes, gen)
                if made is None:
                    continue
                feeds, plan = made
                diff, scale, landed = self._compare_once(feeds, self._follow_up(plan, gen), saved)
                if landed != tuple(key):
                    continue
                checked += 1
                if not diff <= scale * 1e-4 + 1e-6:
                    raise refused(
                        self.model,
                        f"the replayed step of key {tuple(self.dims)}={tuple(key)}, or the step after it, differs from the eager steps on "
                        f"the same valid batches without padding (real sizes {tuple(sizes)}; max abs diff {diff:.3g} "
                        f"of scale {scale:.3g}): "
                        "padding tokens or keys reach real requests (a padding write into a real cache slot, a mask "
                        "that lets a real query see a padding key)",
                    )
                break
        return checked

    def _compare_once(
        self, feeds: dict[str, torch.Tensor], follow: dict[str, torch.Tensor], saved: torch.Tensor
    ) -> tuple[float, float, tuple[int, ...] | None]:
        """Two call sequences from the same cache, ``saved`` (what the cache holds now): ``feeds`` replayed
        (padded to their key) then ``follow`` run eagerly, against both run eagerly without padding; the
        cache put back to ``saved`` after each. ``(max abs diff over both calls, scale, key replayed)``: the
        second call sees what the padding tokens of the first wrote."""
        runner = self.runner
        real = {k: v.clone() for k, v in feeds.items()}
        cache = self.cache
        try:
            got = [runner(**feeds).clone()]
            landed = runner.stats.last_bucket
            got.append(self.step(**follow))
            cache.copy_(saved)
            want = [self.step(**real), self.step(**follow)]
        finally:
            cache.copy_(saved)
        diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want))
        scale = max(b.double().abs().max().item() for b in want)
        return diff, scale, None if landed is None else tuple(landed)

    def _synthetic(
        self, key: Sequence[int], sizes: Sequence[int], gen: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], Plan] | None:
        """A valid batch of ``sizes`` (one per dim of :attr:`dims`) for full/sliding layers: ``reqs`` requests
        whose queries end each prompt, each attention type reading its keys dim's count of the request's
        most recent keys, every real write a distinct real slot; with its plan (per request queries and
        past, per group the past read and the slots) for :meth:`_follow_up`. A write-trash slot that is
        a real slot (a planted bug) is given to a real new token: full layers read it back in this
        batch, sliding layers only in the follow-up."""
        n_tok, n_req = sizes[0], min(sizes[-1], sizes[0])
        kv = {g.index: max(n, n_tok) for g, n in zip(self.groups, sizes[1:-1])}
        if n_tok > key[0] or n_req > key[-1] or any(kv[g.index] > k for g, k in zip(self.groups, key[1:-1])):
            return None
        # split tokens and keys over requests: request r gets q_r >= 1 queries and a past of P_r positions
        cut_q = sorted(torch.randperm(n_tok - 1, generator=gen)[: n_req - 1].add(1).tolist()) if n_req > 1 else []
        lens_q = [b - a for a, b in zip([0] + cut_q, cut_q + [n_tok])]
        extra = max(kv.values()) - n_tok
        cut_e = sorted(torch.randint(0, extra + 1, (n_req - 1,), generator=gen).tolist()) if n_req > 1 else []
        past = [b - a for a, b in zip([0] + cut_e, cut_e + [extra])]
        pos: list[int] = []
        treq: list[int] = []
        logit_idx: list[int] = []
        for r, (q, p) in enumerate(zip(lens_q, past)):
            pos.extend(range(p, p + q))
            treq.extend([r] * q)
            logit_idx.append(len(pos) - 1)
        ids = torch.randint(0, self.vocab, (n_tok,), generator=gen)
        feeds = {
            "input_ids": ids.to(torch.int32),
            "position_ids": torch.tensor(pos, dtype=torch.int32),
            "tok_req": torch.tensor(treq, dtype=torch.int32),
            "logits_indices": torch.tensor(logit_idx, dtype=torch.int32),
        }
        plan: Plan = {"lens_q": lens_q, "past": past, "read_past": {}, "slots": {}}
        for g in self.groups:
            # this type reads the most recent read_past[r] <= past[r] of each request's past positions
            read_past, deficit = list(past), extra - (kv[g.index] - n_tok)
            for r in torch.randperm(n_req, generator=gen).tolist():
                cut = min(read_past[r], deficit)
                read_past[r] -= cut
                deficit -= cut
            n_kv = kv[g.index]
            slots = torch.randperm(g.last_index - g.first_real + 1, generator=gen)[: n_kv + n_req] + g.first_real
            if g.first_real <= g.write_trash <= g.last_index:  # the padding write slot is a real one: meet it
                first_new = read_past[0]  # request 0's first new token
                slots[slots == g.write_trash] = slots[first_new].clone()
                slots[first_new] = g.write_trash
            plan["slots"][g.index], plan["read_past"][g.index] = slots, read_past
            read: list[int] = []
            write: list[int] = []
            kreq: list[int] = []
            kpos: list[int] = []
            at = 0
            for r, (q, p, rp) in enumerate(zip(lens_q, past, read_past)):
                s = slots[at : at + rp + q].tolist()
                at += rp + q
                # full layers: the new tokens' keys written then read back; sliding: sentinels for the new keys
                read.extend(s if g.window is None else s[:rp] + [g.sentinel] * q)
                write.extend(s[rp:])
                kreq.extend([r] * (rp + q))
                kpos.extend(range(p - rp, p + q))
            _put_group(feeds, g, write, read, kreq, kpos)
        dev = self.device
        return {k: v.to(dev) for k, v in feeds.items()}, plan

    def _follow_up(self, plan: Plan, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """The next step after a :meth:`_synthetic` batch: one new token per request, reading every key the
        request wrote or read before (so a real slot a padding token overwrote in that batch is read here)."""
        lens_q, past = plan["lens_q"], plan["past"]
        n_req = len(lens_q)
        dev = self.device
        pos = [p + q for q, p in zip(lens_q, past)]
        feeds = {
            "input_ids": torch.randint(0, self.vocab, (n_req,), generator=gen).to(torch.int32),
            "position_ids": torch.tensor(pos, dtype=torch.int32),
            "tok_req": torch.arange(n_req, dtype=torch.int32),
            "logits_indices": torch.arange(n_req, dtype=torch.int32),
        }
        for g in self.groups:
            slots, read_past = plan["slots"][g.index], plan["read_past"][g.index]
            n_kv = sum(read_past) + sum(lens_q)
            read: list[int] = []
            write: list[int] = []
            kreq: list[int] = []
            kpos: list[int] = []
            at = 0
            for r, (n, rp, q) in enumerate(zip(pos, read_past, lens_q)):
                old, new = slots[at : at + rp + q].tolist(), int(slots[n_kv + r])
                at += rp + q
                read.extend(old + ([new] if g.window is None else [g.sentinel]))
                write.append(new)
                kreq.extend([r] * (rp + q + 1))
                kpos.extend(range(n - rp - q, n + 1))
            _put_group(feeds, g, write, read, kreq, kpos)
        return {k: v.to(dev) for k, v in feeds.items()}


def _put_group(feeds: dict[str, torch.Tensor], g: CacheGroup, write, read, key_req, key_pos) -> None:
    """Write allocator ``g``'s four per-key and per-token inputs (Python lists) into ``feeds``."""
    feeds[f"write_index_{g.index}"] = torch.tensor(write, dtype=torch.int64)
    feeds[f"read_index_{g.index}"] = torch.tensor(read, dtype=torch.int64)
    feeds[f"key_req_{g.index}"] = torch.tensor(key_req, dtype=torch.int32)
    feeds[f"key_pos_{g.index}"] = torch.tensor(key_pos, dtype=torch.int32)
