"""Counters of a speculative run (`out.speculation`).

Words: a *draft* is a token proposed from depth d; it is *verified* when the target for its position (from
depth U of the token before it) is compared with it, and then *accepted* or *rejected*; a draft killed before
its verification (a descendant of a rejected draft, or in flight when its sequence stopped) is *discarded*.

Exact invariants (tested): `accepted + rejected == verified`, `drafted == verified + discarded`,
`committed_tokens` == number of generated tokens,
`core_calls_per_token == core_calls * batch_size / committed_tokens`.

`core_calls_per_token` is the run's calls of the shared stack (prefill included) per token of one sequence: the
calls divided by the mean number of tokens each sequence committed. Every row of a call belongs to the same call,
so a batch of B sequences decoded plainly needs U calls per token, whatever B: the number compares directly with
plain decoding's U and with the cost model d + (U - d)(1 - a). `hf-loopspec bench` reports the same quantity
under the same name.

Second proposals (`second_draft_loops`): `second_drafts` counts sibling lanes spawned (they are not in `drafted`),
`second_accepted` the verifications that chose the sibling. A verification judges one position, whichever of its
one or two candidates it keeps: it is *accepted* when it keeps either, so `second_accepted <= accepted` and
`second_accepted <= second_drafts`, and the identities above hold unchanged (the drafts of a sibling's branch
count in `drafted` and end verified, once the branch is chosen, or discarded).
`core_calls` counts every call of the shared stack in the run, prompt prefill included, across the batch.
`call_rows` lists the row count of every stage call of the run, in order, per stage ("embed", "core", "head"):
what a cost model needs (`hf_loopspec.bench.costs`); it is not part of `to_dict`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SequenceStats:
    committed: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    rejected: int = 0
    discarded: int = 0
    second_drafts: int = 0
    second_accepted: int = 0


def _summed(name: str) -> property:
    """A read-only property: the `SequenceStats` field `name` summed over `per_sequence`."""
    return property(lambda self: sum(getattr(row, name) for row in self.per_sequence),
                    doc=f"`SequenceStats.{name}` summed over the batch.")


@dataclass
class SpeculationStats:
    mode: str
    draft_loops: int
    core_calls: int = 0
    engine: str = "lanes"  # what ran: "wavefront", "lanes" (the reference) or "plain" (a `fallback`)
    cache_fill_calls: int = 0  # calls after decoding that complete the returned cache (rows that stopped early)
    per_sequence: list[SequenceStats] = field(default_factory=list)
    call_rows: dict[str, list[int]] = field(default_factory=lambda: {"embed": [], "core": [], "head": []})
    fallback: str | None = None  # why the call decoded with plain decoding instead (every counter is then 0)

    committed_tokens = _summed("committed")
    drafted = _summed("drafted")
    verified = _summed("verified")
    accepted = _summed("accepted")
    rejected = _summed("rejected")
    discarded = _summed("discarded")
    second_drafts = _summed("second_drafts")
    second_accepted = _summed("second_accepted")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def batch_size(self) -> int:
        return len(self.per_sequence)

    @property
    def core_calls_per_token(self) -> float:
        """Core calls per committed token of one sequence (see the module docstring); 0.0 before any commit."""
        return self.core_calls * self.batch_size / self.committed_tokens if self.committed_tokens else 0.0

    def to_dict(self) -> dict:
        keys = ("committed_tokens", "drafted", "verified", "accepted", "rejected", "discarded", "second_drafts",
                "second_accepted", "acceptance_rate", "core_calls_per_token")
        return {"mode": self.mode, "engine": self.engine, "draft_loops": self.draft_loops, "fallback": self.fallback,
                "core_calls": self.core_calls,
                "cache_fill_calls": self.cache_fill_calls, **{k: getattr(self, k) for k in keys},
                "per_sequence": [asdict(s) for s in self.per_sequence]}

    def __getitem__(self, key: str):
        return self.to_dict()[key]
