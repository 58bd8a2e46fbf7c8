"""How `speculative_mode="auto"` chooses a setting for its next segment, and what it reports (`AutoStats`).

`Chooser` ranks the candidates (`auto_costs.Candidate`) by their estimated speed-up over plain decoding
(`auto_costs.speedup`) at the acceptance observed so far for their draft depth (`Acceptance`: counts of this call's
segments, each earlier segment's weighed by `AutoPolicy.keep` so that a drift shows within a segment or two, started
from what earlier calls with the same decoding settings (sampling, penalties, logits processors, which change how
often a draft agrees: `acceptance_settings`) observed on the same model: this process's, or an earlier
process's stored on disk by `auto_cache`, so that a command-line call need not probe again). A depth never observed
takes the acceptance of the shallowest observed one (a deeper draft is assumed to agree with the target at least as
often).

* Nothing observed yet: if no candidate beats plain decoding by `AutoPolicy.margin` even at acceptance 1, the call
  decodes plainly to the end at once (`reason` "costs": no probe is paid); otherwise a probe segment of
  `AutoPolicy.probe_tokens` runs the candidate that is best at `AutoPolicy.prior` acceptance.
* Observed: the best candidate runs if it beats plain by `margin`, else plain ("acceptance"); after
  `AutoPolicy.reprobe_after` such plain segments the best candidate is probed again, so that a rise in acceptance
  is noticed. Plain chosen for a call's first segment decodes the whole call (on transformers' `DynamicCache`,
  faster than plain decoding on a `PagedLoopCache`); after `AutoPolicy.reprobe_calls` such calls the next one
  probes again.
A segment is `AutoPolicy.interval` tokens, doubled (up to `max_interval`) while the choice stays the same.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from dataclasses import asdict, dataclass, field

from . import auto_cache
from .auto_costs import PLAIN, Candidate, CostTable, speedup
from .stats import SpeculationStats


@dataclass(frozen=True)
class AutoPolicy:
    """The knobs of the choice (module docstring); `set_policy` replaces them for one model (tests)."""

    interval: int = 64  # committed tokens per segment before the choice is revisited
    max_interval: int = 512  # the longest segment while the choice stays the same
    probe_tokens: int = 16  # tokens of a probe segment (acceptance unknown)
    prior: float = 0.75  # acceptance assumed to pick the probe's candidate
    margin: float = 1.05  # a speculative candidate must beat plain decoding by this factor
    reprobe_after: int = 4  # plain segments of a call chosen for low acceptance before the next probe
    reprobe_calls: int = 8  # calls decoded plainly for low acceptance before a call probes again
    min_verified: int = 8  # verifications before a depth's acceptance counts as observed
    keep: float = 0.5  # weight of the earlier counts when a segment's are added (recent segments weigh more)


@dataclass
class Acceptance:
    """Accepted and verified drafts per draft depth, the earlier segments' down-weighted (`AutoPolicy.keep`)."""

    accepted: dict[int, float] = field(default_factory=dict)
    verified: dict[int, float] = field(default_factory=dict)
    plain_calls: int = 0  # calls decoded plainly throughout, for low acceptance, since the last probe

    def add(self, depth: int, accepted: int, verified: int, keep: float = 1.0) -> None:
        self.accepted[depth] = self.accepted.get(depth, 0) * keep + accepted
        self.verified[depth] = self.verified.get(depth, 0) * keep + verified

    def rate(self, depth: int, min_verified: int) -> float | None:
        """Observed acceptance at `depth` (or at the shallowest observed depth); None when nothing is observed."""
        seen = sorted(d for d, n in self.verified.items() if n >= min_verified)
        if not seen:
            return None
        use = depth if depth in seen else seen[0]
        return self.accepted[use] / self.verified[use]

    def copy(self) -> Acceptance:
        return Acceptance(dict(self.accepted), dict(self.verified), self.plain_calls)

    def encode(self) -> dict:
        """A JSON form (depths as strings), read back by `decode`."""
        return {"accepted": {str(d): n for d, n in self.accepted.items()},
                "verified": {str(d): n for d, n in self.verified.items()}, "plain_calls": self.plain_calls}

    @classmethod
    def decode(cls, data) -> Acceptance:
        """`encode`'s form back; anything else (None, a damaged file) is an empty `Acceptance`."""
        try:
            counts = [{int(d): float(n) for d, n in data[name].items()} for name in ("accepted", "verified")]
            plain_calls = int(data["plain_calls"])
        except (TypeError, KeyError, ValueError, AttributeError, OverflowError):  # (Infinity, a 400-digit count)
            return cls()
        accepted, verified = counts
        if set(accepted) != set(verified) or plain_calls < 0 or not all(
                math.isfinite(verified[d]) and 0 <= accepted[d] <= verified[d] for d in verified):
            return cls()  # counts no decoding could have made (NaN, more accepted than verified)
        return cls(accepted, verified, plain_calls)


@dataclass
class AutoChoice:
    """One segment of an auto call: what ran, from which committed token, for how many, and why."""

    at_token: int  # columns generated before the segment (per sequence)
    mode: str  # "plain", "pipeline" or "block"
    draft_loops: int | None
    num_speculative_tokens: int | None
    tokens: int  # columns the segment generated
    reason: str  # "costs" (plain to the end: no setting can win), "probe", "acceptance", "reprobe", "stopped-rows",
    # "cache-type" (continuing a kind of cache that cannot back speculation, e.g. a StaticCache), "capacity" (a
    # fixed-capacity PagedLoopCache too small for a speculative segment's up-front reservation), "position-ids" (the
    # call passes positions of its own), "fallback" (a speculative segment decoded plainly: `AutoStats.fallback`)
    acceptance: float | None  # the observed acceptance the choice used (None: not known yet)
    speedups: dict[str, float]  # estimated speed-up over plain of every candidate (`Candidate.name`)
    seconds: float  # wall time of the segment's `generate` call (on CUDA: synchronized at its end)


@dataclass
class AutoStats(SpeculationStats):
    """`out.speculation` of an auto call: the counters of every segment summed (plain segments count their
    committed tokens and U core calls per column), and the segments (`choices`); `switches` lists the committed
    token at which each change of setting took effect; `engine` is "plain" when no speculative segment ran."""

    choices: list[AutoChoice] = field(default_factory=list)
    plain_tokens: int = 0  # columns decoded by plain segments
    switches: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "plain_tokens": self.plain_tokens, "switches": list(self.switches),
                "choices": [asdict(c) for c in self.choices]}


_MEMORY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its acceptance key, {settings:
# Acceptance} of earlier calls under that key)
_POLICIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> AutoPolicy
_UNREMOVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the key whose file `forget` could not
# remove (an unwritable folder): its entries are what this process forgot
_LOCK = threading.Lock()  # guards `_MEMORY`'s dicts: threads decoding one model read and update them
KEPT_SETTINGS = 32  # decoding settings whose acceptance is kept per model (a sweep of settings keeps the file small)


def _observed(model, key: dict) -> dict[str, Acceptance]:
    """What earlier calls observed on `model` under its acceptance `key` (`auto_cache.acceptance_key`: one file per
    model, one entry per settings), by their settings: this process's, else an earlier process's stored on disk,
    else nothing. A model whose key changed since (`model.to(dtype)`, an edited config) reads its new key's."""
    kept = _MEMORY.get(model)  # (called with `_LOCK` held)
    if kept is None or kept[0] != key:
        kept = _MEMORY[model] = (key, _decoded(auto_cache.load(key, "acceptance")))
    return kept[1]


def _decoded(stored) -> dict[str, Acceptance]:
    """The entries of a stored acceptance file (`remember`), oldest first; none for anything else."""
    entries = stored.get("by_settings") if isinstance(stored, dict) else None
    return {str(k): Acceptance.decode(v) for k, v in entries.items()} if isinstance(entries, dict) else {}


ACCEPTANCE_SETTINGS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                       "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "sequence_bias")


def call_setting(kwargs: dict, config, key: str):
    """A call's setting `key`: its keyword argument, else its (merged) generation config's."""
    return kwargs[key] if key in kwargs else getattr(config, key, None)


# Settings measured from the call's start or its end (transformers builds them from the input length or max_length
# of each `generate` call), and criteria that may stop the call: a call with any of them decodes as one segment.
ONE_STRETCH = ("stopping_criteria", "stop_strings", "max_time", "forced_eos_token_id", "begin_suppress_tokens",
               "exponential_decay_length_penalty", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size",
               "guidance_scale", "watermarking_config")
NEUTRAL = {"encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0, "guidance_scale": 1.0}


def one_stretch(kwargs: dict, config) -> bool:
    """Whether a call sets a `ONE_STRETCH` setting that does anything: not None, not its neutral value, not an empty
    list (an array or tensor of ids is compared with nothing: numpy met `value == None` elementwise, and an empty one
    still forces transformers' processor)."""
    def in_effect(key: str, value) -> bool:
        if value is None or key in NEUTRAL and value == NEUTRAL[key]:
            return False
        return not (isinstance(value, (list, tuple)) and not value)

    return any(in_effect(key, call_setting(kwargs, config, key)) for key in ONE_STRETCH)


def acceptance_settings(kwargs: dict, config, loops: int) -> str:
    """The settings of a call that change how often drafts are accepted, as the key of the acceptance earlier calls
    observed (`remembered`): `ACCEPTANCE_SETTINGS`, the class names of the call's own logits processors, whether a
    draft hook (tests, the bench's synthetic drafts) replaces the model's drafts, and the call's loop count `loops`
    (Huginn's `num_steps`: the depth drafts are verified at)."""
    values = {key: call_setting(kwargs, config, key) for key in ACCEPTANCE_SETTINGS} | {"loops": loops}
    if isinstance(values["sequence_bias"], dict):  # {(ids...): bias}: tuple keys, which JSON cannot hold
        values["sequence_bias"] = sorted([list(ids), bias] for ids, bias in values["sequence_bias"].items())
    values["logits_processor"] = [type(p).__qualname__ for p in kwargs.get("logits_processor") or ()]
    values["draft_hook"] = kwargs.get("draft_hook") is not None
    return json.dumps(values, sort_keys=True, default=repr)


def remembered(model, settings: str) -> Acceptance:
    """The acceptance earlier auto calls with the same `settings` (the decoding settings that change how often drafts
    are accepted: `acceptance_settings`) observed on `model` (a copy), or an empty one."""
    key = auto_cache.acceptance_key(model)
    with _LOCK:
        return _observed(model, key).get(settings, Acceptance()).copy()


def remember(model, acceptance: Acceptance, settings: str) -> None:
    """Keep `acceptance` for `model`'s next auto calls with `settings`, in this process and on disk for later ones
    (the `KEPT_SETTINGS` most recently used settings). The file is read again and changed under its lock
    (`auto_cache.update`): the entries other processes stored since this one read it stay, and this process sees
    them; for a settings this process holds, its own entry replaces the stored one."""
    key = auto_cache.acceptance_key(model)

    def changed(stored) -> dict:
        observed = _observed(model, key)
        others = {} if _UNREMOVED.get(model) == key else _decoded(stored)  # (not a forgotten file's)
        observed.update((k, v) for k, v in others.items() if k not in observed)  # other processes'
        observed.pop(settings, None)
        observed[settings] = acceptance.copy()  # dicts keep insertion order: the oldest settings come first
        while len(observed) > KEPT_SETTINGS:
            del observed[next(iter(observed))]
        return {"by_settings": {k: v.encode() for k, v in observed.items()}}

    with _LOCK:  # (a `forget` waits for the store)
        auto_cache.update(key, changed, "acceptance")


def looped_model(model, where: str):
    """The looped causal LM of this package that `model` is or wraps (a PEFT model's base model, the module that
    torch.compile wrapped): the object auto keys what it observes by, since `generate` runs on it. `ValueError`
    naming `where` for anything else."""
    if callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    model = getattr(model, "_orig_mod", model)
    if not all(hasattr(model, name) for name in ("kv_layout", "lane_dtype", "num_loops")):
        raise ValueError(f"{where}: model is {type(model).__name__}, not a looped model of hf_loopspec; pass the "
                         "OuroForCausalLM or HuginnForCausalLM whose auto calls it is about.")
    return model


def forget(model) -> None:
    """Drop what earlier calls observed on `model` (or the looped model it wraps: `looped_model`), for every setting,
    here and on disk (the next call starts without an acceptance). Its weights are fingerprinted anew first: after
    an in-place change (`load_state_dict`, a merged adapter) it files what it sees under its new weights, and the
    acceptance stored for the weights before stays theirs."""
    model = looped_model(model, "auto_policy.forget")
    with _LOCK:  # (a `remember` under way stores first, then this removes it)
        auto_cache.weights_fingerprint(model, again=True)
        key = auto_cache.acceptance_key(model)
        _MEMORY[model] = (key, {})  # (nothing observed, whether or not the file below can be removed)
        if auto_cache.forget(key, "acceptance"):
            _UNREMOVED.pop(model, None)
        else:  # (its entries predate the forget: `remember` leaves them out)
            _UNREMOVED[model] = key


def set_policy(model, policy: AutoPolicy | None) -> None:
    """Use `policy` for `model`'s auto calls (None: the default); a wrapper's apply to the model it wraps."""
    model = looped_model(model, "auto_policy.set_policy")
    if policy is not None and not isinstance(policy, AutoPolicy):
        raise ValueError(f"auto_policy.set_policy: policy is {type(policy).__name__}; pass an AutoPolicy (e.g. "
                         "dataclasses.replace(AutoPolicy(), margin=...)), or None for the default.")
    if policy is None:
        _POLICIES.pop(model, None)
    else:
        _POLICIES[model] = policy


def policy_for(model) -> AutoPolicy:
    return _POLICIES.get(model, AutoPolicy())


@dataclass
class Chooser:
    """The choice of one call's segments (module docstring)."""

    costs: CostTable
    candidates: list[Candidate]
    loops: int
    policy: AutoPolicy
    acceptance: Acceptance
    plain_streak: int = 0  # consecutive plain segments chosen for low acceptance
    last: Candidate | None = None
    length: int = 0  # tokens of the last segment

    def estimates(self, rate_of) -> dict[Candidate, float]:
        return {c: speedup(self.costs, c, self.loops, rate_of(c)) for c in self.candidates}

    def next(self, first: bool = False) -> tuple[Candidate, int | None, str, float | None, dict[str, float]]:
        """(candidate, tokens or None for the rest of the call, reason, acceptance used, speed-ups by name). For the
        `first` segment of a call, plain decoding chosen for low acceptance is for the whole call (it then needs no
        cache that later segments can continue), unless `reprobe_calls` such calls came since the last probe."""
        policy = self.policy
        speculative = [c for c in self.candidates if c.mode is not None]
        observed = self.acceptance.rate(1, policy.min_verified) is not None
        if not observed:
            optimistic = self.estimates(lambda c: 1.0)
            if not speculative or max(optimistic[c] for c in speculative) < policy.margin:
                return PLAIN, None, "costs", None, _named(optimistic)
            prior = self.estimates(lambda c: policy.prior)
            best = max(speculative, key=prior.get)
            return self._run(best, policy.probe_tokens, "probe", None, prior)
        rates = {c: self.acceptance.rate(c.draft_loops or 1, policy.min_verified) for c in self.candidates}
        estimates = self.estimates(rates.get)
        best = max(speculative, key=estimates.get)
        if estimates[best] >= policy.margin:
            self.plain_streak = 0
            return self._run(best, None, "acceptance", rates[best], estimates)
        streak, limit = (self.acceptance.plain_calls, policy.reprobe_calls) if first else (self.plain_streak,
                                                                                          policy.reprobe_after)
        if streak >= limit:
            self.plain_streak = self.acceptance.plain_calls = 0
            return self._run(best, policy.probe_tokens, "reprobe", rates[best], estimates)
        if first:
            self.acceptance.plain_calls += 1
            return PLAIN, None, "acceptance", rates[best], _named(estimates)
        self.plain_streak += 1
        return self._run(PLAIN, None, "acceptance", rates[best], estimates)

    def _run(self, candidate: Candidate, tokens: int | None, reason: str, rate: float | None,
             estimates: dict[Candidate, float]):
        """Record the choice; the segment length: `tokens`, or the interval (doubled while unchanged)."""
        if tokens is None:
            unchanged = candidate == self.last
            tokens = min(self.length * 2, self.policy.max_interval) if unchanged else self.policy.interval
        self.last, self.length = candidate, tokens
        return candidate, tokens, reason, rate, _named(estimates)


def _named(estimates: dict[Candidate, float]) -> dict[str, float]:
    return {c.name: round(v, 4) for c, v in estimates.items()}
